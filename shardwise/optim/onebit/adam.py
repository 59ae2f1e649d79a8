"""1-bit Adam (Tang et al., 2021, arXiv:2102.02888): Adam whose momentum, after a
warm-up, is averaged across ranks in 1-bit compressed form."""

from __future__ import annotations

import logging

import torch

from shardwise.optim.onebit._base import CompressedOptimizer, check_adam_arguments, check_freeze_step

logger = logging.getLogger("shardwise")


class OneBitAdam(CompressedOptimizer):
    """1-bit Adam with DeepSpeed's arguments and defaults.

    Warm-up (the first ``freeze_step`` steps): Adam on gradients the engine averaged in
    full precision, with decoupled weight decay (torch's AdamW arithmetic)::

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        w = w - lr (m / c1 / (sqrt(v / c2) + eps) + weight_decay w)

    with ``c1 = 1 - b1^t``, ``c2 = 1 - b2^t`` (1 when ``bias_correction`` is false).
    After it, the variance is frozen (``c2`` with it) and the gradients stay on their
    rank: each rank updates the momentum with its own gradient, and the momenta are
    averaged by the 1-bit compressed all-reduce with error feedback
    (``shardwise.comm.CompressedAllReduce``), all parameters in one exchange, before the
    same update. After the exchange the momentum is zeroed where a param group's
    ``exp_avg_mask`` (DeepSpeed's key) is 0 and where the frozen variance is exactly 0
    (see ``mask_unmeasured_``). The engine switches from averaging gradients to leaving them local by
    asking :meth:`averages_gradients_itself` (see [Note: optimizers that exchange data
    themselves] in ``_base.py``).

    Differences from DeepSpeed's OnebitAdam, which also ignored ``bias_correction`` and
    ``eps_inside_sqrt`` and skipped the parameter update of the very first step: here
    ``bias_correction`` (default True, as declared there too) and ``eps_inside_sqrt`` are
    applied and every step updates the parameters, so the warm-up equals
    ``torch.optim.AdamW``; ``bias_correction=False`` gives DeepSpeed's update rule.

    Args:
        params: parameters or param-group dicts.
        deepspeed: DeepSpeed passed its engine here; accepted and unused (the engine
            binds its data-parallel group instead).
        lr, betas, eps, weight_decay: as in Adam (weight decay decoupled).
        freeze_step: warm-up steps before compression starts (>= 1).
        bias_correction: correct the moments for their zero start.
        eps_inside_sqrt: use ``sqrt(v / c2 + eps)`` instead of ``sqrt(v / c2) + eps``.
        max_grad_norm: must be 0; clip with the ``gradient_clipping`` config key.
        amsgrad: must be False (as in DeepSpeed).
        cuda_aware: DeepSpeed's MPI switch; no effect (torch.distributed moves the data).
        comm_backend_name: ``"nccl"``, ``"mpi"``, ``"hccl"`` or ``"compressed"``; all run on
            the torch.distributed backend of the job (logged once).
    """

    def __init__(
        self,
        params,
        deepspeed=None,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ):
        del deepspeed
        name = type(self).__name__
        check_adam_arguments(name, amsgrad=amsgrad, lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        check_freeze_step(name, "freeze_step", freeze_step)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            eps_inside_sqrt=eps_inside_sqrt,
        )
        super().__init__(
            params, defaults, comm_backend_name=comm_backend_name, cuda_aware=cuda_aware, max_grad_norm=max_grad_norm
        )
        self.freeze_step = freeze_step
        self._frozen_denominators: dict = {}
        """param -> (eps, eps_inside_sqrt, c2), ``sqrt(v / c2) + eps``: computed once after the
        warm-up (an allocation and two passes per parameter and step saved)."""

    def averages_gradients_itself(self) -> bool:
        """True once ``freeze_step`` steps are done: gradients stay local from then on."""
        return self.steps_taken() >= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressed = self.averages_gradients_itself()
        if compressed and self.steps_taken() == self.freeze_step:
            comm = self.communicator()
            if comm is None or comm.rank == 0:
                logger.info(
                    "%s: warm-up of %d steps done; the variance is frozen and the momentum is exchanged "
                    "1-bit compressed from now on",
                    type(self).__name__,
                    self.freeze_step,
                )
        work = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None and not compressed:
                    continue
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                state["exp_avg"].lerp_(grad, 1 - beta1)
                if not compressed:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["step"] += 1
                work.append((group, p, state))
        if compressed:
            self.compressed_average_(
                [state["exp_avg"] for _, _, state in work], tag="momentum", params=[p for _, p, _ in work], state=True
            )
            for group, _, state in work:
                self.mask_unmeasured_(group, state["exp_avg"], state["exp_avg_sq"])
        for group, p, state in work:
            self._update(group, p, state)
        return loss

    def _update(self, group: dict, p: torch.Tensor, state: dict) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        step = int(state["step"])
        if group["bias_correction"]:
            c1 = 1 - beta1**step
            c2 = 1 - beta2 ** min(step, self.freeze_step)  # the variance stopped at freeze_step
        else:
            c1 = c2 = 1.0
        if weight_decay:
            p.mul_(1 - lr * weight_decay)
        frozen = step > self.freeze_step
        key = (eps, group["eps_inside_sqrt"], c2)
        cached = self._frozen_denominators.get(p) if frozen else None
        if cached is not None and cached[0] == key:
            denom = cached[1]  # the variance and its correction no longer change
        else:
            if group["eps_inside_sqrt"]:
                denom = (state["exp_avg_sq"] / c2).add_(eps).sqrt_()
            else:
                denom = (state["exp_avg_sq"].sqrt() / c2**0.5).add_(eps)
            if frozen:
                self._frozen_denominators[p] = (key, denom)
        p.addcdiv_(state["exp_avg"], denom, value=-lr / c1)

    def load_state_dict(self, state_dict) -> None:
        self._frozen_denominators.clear()
        super().load_state_dict(state_dict)
