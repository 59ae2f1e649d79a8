"""1-bit LAMB (Li et al., 2021, arXiv:2104.06069): LAMB whose momentum, after a warm-up,
is averaged across ranks in 1-bit compressed form, with the trust ratios frozen and
adjusted by how far the variance has moved since."""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

from shardwise.optim.lamb import lamb_update_
from shardwise.optim.onebit._base import CompressedOptimizer, check_adam_arguments, check_freeze_step

logger = logging.getLogger("shardwise")


class OneBitLamb(CompressedOptimizer):
    """1-bit LAMB with DeepSpeed's arguments and defaults.

    Warm-up (the first ``freeze_step`` steps): LAMB on gradients the engine averaged in
    full precision, the arithmetic of :class:`shardwise.optim.Lamb` (equal to it)::

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        u = m / c1 / (sqrt(v / c2) + eps) + weight_decay w
        w = w - lr r u,   r = clamp(||w|| / ||u||, min_coeff, max_coeff)

    and each parameter keeps ``lamb_coeff_freeze``, the moving average of its trust ratio
    ``r`` with rate ``coeff_beta`` (over the steps where both norms are non-zero).

    After it, the gradients stay on their rank. The variance ``v`` and the trust ratio are
    frozen; each rank updates the momentum with its own gradient and the momenta are
    averaged by the 1-bit compressed all-reduce with error feedback, all parameters in one
    exchange. Before the exchange each momentum is multiplied by ``scaling_coeff`` (fixed at
    the first compressed step: the mean over parameters of ``||m|| / sqrt(numel)`` divided by
    this parameter's), so that parameters of very different scales share the exchange's
    chunks without drowning each other; it is divided out after. The gradient is then
    reconstructed from the averaged momentum, ``(m - b1 m_prev) / (1 - b1)``, to update a
    fresh variance ``exp_avg_sq_fresh`` (the frozen one continued), and the trust ratio is
    ``lamb_coeff_freeze * factor`` with::

        factor = max over elements of (sqrt(v / c2) + eps) / (sqrt(v_fresh / c2') + eps)

    (with weight decay, mixed towards 1 by the share of ``||m / ...||`` in ``||u||``),
    clamped to ``[factor_min, factor_max]`` and to within ``factor_threshold`` of the
    previous step's factor. :meth:`averages_gradients_itself` is True from the step after
    ``freeze_step``.

    Differences from DeepSpeed's OnebitLamb:

    * every step updates the parameters (DeepSpeed's first step only set up buffers);
    * ``bias_correction`` and ``eps_inside_sqrt`` are applied (DeepSpeed ignored both), so the
      warm-up is :class:`shardwise.optim.Lamb`; ``c2`` of the frozen variance stays at the
      freeze and ``c2'`` of the fresh one keeps counting. With ``bias_correction`` the
      frozen trust ratio is also corrected for the moving average's zero start (divided by
      ``1 - coeff_beta^n``, ``n`` its updates), which DeepSpeed did not do; it asked for
      ``freeze_step >= 1 / (1 - coeff_beta)`` instead. ``bias_correction=False`` gives its
      rules;
    * a parameter whose momentum is all zero at the first compressed step gets
      ``scaling_coeff`` 1 (DeepSpeed divided by zero).

    State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``, ``lamb_coeff_freeze`` and
    ``lamb_coeff_count`` (0-dim), and after the warm-up ``exp_avg_sq_fresh`` (like the
    parameter), ``scaling_coeff``, ``frozen_step`` (the variance's updates) and
    ``last_factor``; saved with the checkpoint by parameter name.

    Args:
        params: parameters or param-group dicts.
        deepspeed: DeepSpeed passed its engine here; accepted and unused (the engine binds
            its data-parallel group instead).
        lr, betas, eps, weight_decay: as in :class:`shardwise.optim.Lamb`.
        freeze_step: warm-up steps before compression starts (>= 1).
        bias_correction: correct the moments (and the frozen trust ratio) for their zero start.
        eps_inside_sqrt: use ``sqrt(v / c2 + eps)`` instead of ``sqrt(v / c2) + eps``.
        max_grad_norm: must be 0; clip with the ``gradient_clipping`` config key.
        max_coeff, min_coeff: bounds of the warm-up's trust ratio.
        amsgrad: must be False (as in DeepSpeed).
        cuda_aware: DeepSpeed's MPI switch; no effect (torch.distributed moves the data).
        comm_backend_name: ``"nccl"``, ``"mpi"``, ``"hccl"`` or ``"compressed"``; all run on
            the torch.distributed backend of the job (logged once).
        coeff_beta: rate of the trust ratio's moving average during the warm-up.
        factor_max, factor_min: bounds of the factor on the frozen trust ratio.
        factor_threshold: the most the factor may change from one step to the next, relative.
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
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ):
        del deepspeed
        name = type(self).__name__
        check_adam_arguments(name, amsgrad=amsgrad, lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        check_freeze_step(name, "freeze_step", freeze_step)
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"{name}: needs 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        if not 0 <= coeff_beta < 1:
            raise ValueError(f"{name}: coeff_beta must be in [0, 1), got {coeff_beta}")
        if not 0 < factor_min <= factor_max or factor_threshold < 0:
            raise ValueError(
                f"{name}: needs 0 < factor_min <= factor_max and factor_threshold >= 0, got "
                f"factor_min={factor_min}, factor_max={factor_max}, factor_threshold={factor_threshold}"
            )
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "eps_inside_sqrt": eps_inside_sqrt,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(
            params, defaults, comm_backend_name=comm_backend_name, cuda_aware=cuda_aware, max_grad_norm=max_grad_norm
        )
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self._lamb_coeffs: list[torch.Tensor] = []
        self._previous: dict = {}
        """param -> a buffer for last step's momentum (then the gradient rebuilt from it)."""
        self._frozen_denominators: dict = {}
        """param -> (key, the frozen variance's denominator), computed once after the warm-up."""

    def load_state_dict(self, state_dict) -> None:
        self._previous.clear()
        self._frozen_denominators.clear()
        super().load_state_dict(state_dict)

    def averages_gradients_itself(self) -> bool:
        """True once ``freeze_step`` steps are done: gradients stay local from then on."""
        return self.steps_taken() >= self.freeze_step

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios the last step applied, one per parameter it updated (DeepSpeed's
        accessor; reading them synchronises with the device)."""
        return [float(c) for c in self._lamb_coeffs]

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["lamb_coeff_freeze"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["lamb_coeff_count"] = torch.zeros((), dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """LAMB during the warm-up, then the compressed step; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._lamb_coeffs = []
        if self.averages_gradients_itself():
            self._compressed_step()
            return loss
        for group in self.param_groups:
            buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                buckets[(p.device, p.dtype)].append(p)
            for params in buckets.values():
                self._warm_up_update(group, params)
        return loss

    # -- warm-up: LAMB, recording the trust ratios ----------------------------------------------

    def _warm_up_update(self, group: dict, params: list[torch.Tensor]) -> None:
        """One LAMB step over ``params`` (same device and dtype, all with gradients): the
        ``Lamb`` optimizer's own update, whose trust ratios are averaged here."""
        states = [self._state(p) for p in params]
        clamped, measured, trust = lamb_update_(group, params, states)
        averages = torch.stack([s["lamb_coeff_freeze"] for s in states])
        averages = torch.where(measured, averages * self.coeff_beta + (1 - self.coeff_beta) * clamped, averages)
        for s, average, seen in zip(states, averages.unbind(), measured.unbind()):
            s["lamb_coeff_freeze"].copy_(average)
            s["lamb_coeff_count"].add_(seen.float())
        self._lamb_coeffs.extend(trust.unbind())

    def _corrections(self, group: dict, momentum_steps: list[int], variance_steps: list[int]):
        """``c1`` and ``c2`` per parameter (1 without bias correction or before any update)."""
        beta1, beta2 = group["betas"]
        if not group["bias_correction"]:
            return [1.0] * len(momentum_steps), [1.0] * len(variance_steps)
        return (
            [1 - beta1**t if t else 1.0 for t in momentum_steps],
            [1 - beta2**t if t else 1.0 for t in variance_steps],
        )

    # -- after the warm-up: compressed momentum, frozen variance and trust ratio ----------------

    def _compressed_step(self) -> None:
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                work.append((group, p, self._state(p)))
        if "scaling_coeff" not in work[0][2]:
            self._freeze([state for _, _, state in work], self.exchange_keys([p for _, p, _ in work]))
        previous = []
        for _, p, state in work:  # kept buffers: a fresh tensor per step costs its page faults on the CPU
            buffer = self._previous.get(p)
            if buffer is None or buffer.shape != state["exp_avg"].shape:
                buffer = self._previous[p] = torch.empty_like(state["exp_avg"])
            previous.append(buffer.copy_(state["exp_avg"]))
        momenta = []
        for group, p, state in work:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            state["exp_avg"].lerp_(grad, 1 - group["betas"][0]).mul_(state["scaling_coeff"])
            state["step"] += 1
            momenta.append(state["exp_avg"])
        self.compressed_average_(momenta, tag="momentum", params=[p for _, p, _ in work], state=True)
        for (group, p, state), m_prev in zip(work, previous):
            state["exp_avg"].div_(state["scaling_coeff"])
            self.mask_unmeasured_(group, state["exp_avg"], state["exp_avg_sq"])
            self._frozen_update(group, p, state, m_prev)

    def _freeze(self, states: list[dict], keys: list[str]) -> None:
        """At the first compressed step: fix each momentum's scaling for the exchange, and
        start the fresh variance from the frozen one."""
        comm = self.communicator()
        if comm is None or comm.rank == 0:
            logger.info(
                "%s: warm-up of %d steps done; the variance and trust ratios are frozen and the momentum "
                "is exchanged 1-bit compressed from now on",
                type(self).__name__,
                self.freeze_step,
            )
        scales = [float(torch.linalg.vector_norm(s["exp_avg"])) / s["exp_avg"].numel() ** 0.5 for s in states]
        # united within each exchange (see [Note: copies on several model-parallel ranks])
        united = {key: sum(sc for sc, k in zip(scales, keys) if k == key) / keys.count(key) for key in set(keys)}
        for state, scale, key in zip(states, scales, keys):
            state["scaling_coeff"] = united[key] / scale if scale > 0 and united[key] > 0 else 1.0
            state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
            state["frozen_step"] = int(state["step"])
            state["last_factor"] = torch.ones((), dtype=torch.float32, device=state["exp_avg"].device)

    def _frozen_update(self, group: dict, p: torch.Tensor, state: dict, m_prev: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        exp_avg, fresh = state["exp_avg"], state["exp_avg_sq_fresh"]
        grad = m_prev.mul_(-beta1).add_(exp_avg).div_(1 - beta1)  # exp_avg - beta1 m_prev, in m_prev's buffer
        fresh.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = int(state["step"])
        (c1,), (c2, c2_fresh) = self._corrections(group, [step], [state["frozen_step"], step])
        frozen = state["exp_avg_sq"]
        key = (c2, eps, group["eps_inside_sqrt"], id(frozen), frozen._version)  # a loaded or changed one: recompute
        cached = self._frozen_denominators.get(p)
        if cached is None or cached[0] != key:  # the frozen variance's denominator does not change
            cached = self._frozen_denominators[p] = (
                key,
                self._denominator(state["exp_avg_sq"], c2, eps, group["eps_inside_sqrt"]),
            )
        denom = cached[1]
        denom_fresh = self._denominator(fresh, c2_fresh, eps, group["eps_inside_sqrt"])
        update = (exp_avg / c1).div_(denom)
        factor = torch.div(denom, denom_fresh, out=denom_fresh).max().float()
        if weight_decay:
            adam_norm = torch.linalg.vector_norm(update)
            update.add_(p, alpha=weight_decay)
            update_norm = torch.linalg.vector_norm(update)
            share = torch.where(update_norm > 0, adam_norm / update_norm, torch.ones_like(update_norm))
            share = share.clamp(max=1.0).float()
            factor = factor * share + (1 - share)
        last = state["last_factor"]
        factor = factor.clamp(self.factor_min, self.factor_max)
        factor = torch.minimum(
            torch.maximum(factor, last * (1 - self.factor_threshold)), last * (1 + self.factor_threshold)
        )
        last.copy_(factor)
        coeff = self._frozen_coeff(group, state) * factor
        p.add_(update.mul_(coeff.to(update.dtype)), alpha=-group["lr"])
        self._lamb_coeffs.append(coeff)

    def _frozen_coeff(self, group: dict, state: dict) -> torch.Tensor:
        """The trust ratio's moving average, corrected for its zero start when asked."""
        average, count = state["lamb_coeff_freeze"], state["lamb_coeff_count"]
        if not group["bias_correction"]:
            return average
        return torch.where(count > 0, average / (1 - self.coeff_beta**count), average)

    @staticmethod
    def _denominator(v: torch.Tensor, c2: float, eps: float, inside: bool) -> torch.Tensor:
        if inside:
            return (v / c2).add_(eps).sqrt_()
        return (v.sqrt() / c2**0.5).add_(eps)
