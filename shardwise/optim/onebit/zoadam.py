"""0/1 Adam (Lu et al., 2022, arXiv:2202.06009): Adam that updates its variance on ever
rarer steps, averages the other steps' gradients in 1-bit compressed form, and after the
variance freezes takes local steps that synchronise only every few steps."""

from __future__ import annotations

import logging

import torch

from shardwise.optim.onebit._base import CompressedOptimizer, check_adam_arguments, check_freeze_step

logger = logging.getLogger("shardwise")


def _check_count(owner: str, key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {key} must be an integer >= 1, got {value!r}")


class ZeroOneAdam(CompressedOptimizer):
    """0/1 Adam with DeepSpeed's arguments and defaults.

    Steps ``t = 1, 2, ...`` follow one schedule, kept in every parameter's state:

    * ``t <= var_freeze_step`` and ``t`` a multiple of ``var_interval``: a variance step.
      The engine averages the gradients in full precision (:meth:`averages_gradients_itself`
      is False for it) and both moments are updated, as in Adam. Every
      ``var_update_scaler`` variance steps, ``var_interval`` doubles (it starts at 1).
    * the other ``t <= var_freeze_step``: the gradients stay on their rank, are averaged by
      the 1-bit compressed all-reduce with error feedback inside :meth:`step`, and only the
      momentum takes them; the parameter moves with the variance as it is.
    * ``t > var_freeze_step``: the variance is frozen and the error buffers are zeroed on
      the first such step. Each step is local (no communication): the momentum takes the
      rank's own gradient and the parameter moves. On steps where ``t`` is a multiple of
      ``local_step_interval`` the ranks synchronise: the update accumulated since the last
      synchronisation, multiplied by the frozen ``sqrt(v) + eps``, is averaged compressed;
      the momentum is reset to that average over the summed learning rates, and every rank
      re-applies the average divided by ``sqrt(v) + eps`` to the parameter of the last
      synchronisation. Every ``local_step_scaler`` frozen steps ``local_step_interval``
      doubles, up to ``local_step_clipper``.

    The update is AdamW's, ``w = w (1 - lr weight_decay) - lr m / c1 / (sqrt(v / c2) + eps)``,
    with ``c1 = 1 - b1^t`` and ``c2 = 1 - b2^n``, ``n`` the number of variance steps taken
    (the variance averaged ``n`` gradients from a zero start), so the variance steps alone
    form a bias-corrected Adam; ``bias_correction=False`` makes both 1. A synchronisation
    stores the momentum multiplied by ``c1`` so that the next step's ``m / c1`` is the
    averaged (corrected) momentum.

    Every parameter steps every step (a missing gradient counts as zero): the schedule is
    shared, and each exchange needs the same tensors on every rank. All parameters travel
    in one exchange, each brought to a common scale first (see [Note: balancing the
    parameters in one exchange]). The state per parameter: ``step``, ``exp_avg``,
    ``exp_avg_sq``, the schedule (``var_interval``, ``var_counter``, ``var_updates``,
    ``local_step_interval``, ``local_step_counter``), and after the freeze ``param_at_sync`` (like the parameter),
    ``lrs`` and ``decay`` (the learning rates summed and the weight-decay factors multiplied
    since the last synchronisation); all are saved with the checkpoint by parameter name.
    A checkpoint holds one copy of the parameters and of this state (rank 0's) plus each
    rank's error buffers, so one saved after a synchronisation (or before the freeze)
    resumes exactly; one saved after a local step resumes every rank from rank 0's local
    progress since the last synchronisation.

    Differences from DeepSpeed's ZeroOneAdam:

    * every step updates the parameters (DeepSpeed's first step only set up buffers). Its
      step counter included that step, so its rules (variance step when the count is a
      multiple of ``var_interval``, the freeze, the synchronisations) saw one more than
      the updates taken; here they see the update's own number, step 1 being the first;
    * DeepSpeed skipped parameters without a gradient and exchanged each parameter
      separately (two collectives per parameter and exchange); here every parameter steps
      and one exchange carries them all, balanced;
    * ``bias_correction`` and ``eps_inside_sqrt`` are applied (DeepSpeed ignored both);
      ``bias_correction=False`` gives its update rule;
    * DeepSpeed kept the sum of the local updates and undid it by subtraction, which leaves
      each rank its own rounding; here the parameter of the last synchronisation is kept
      (the same memory) and the accumulated update is ``w - decay * param_at_sync``, so the
      ranks re-apply the same average to the same tensor and agree bit for bit;
    * weight decay multiplies the parameter on local steps and is not part of the exchanged
      update (DeepSpeed folded ``weight_decay * w`` into it, and so into the momentum).

    Args:
        params: parameters or param-group dicts.
        deepspeed: DeepSpeed passed its engine here; accepted and unused (the engine asks
            :meth:`averages_gradients_itself` instead of being switched by the optimizer).
        lr, betas, eps, weight_decay: as in Adam (weight decay decoupled).
        bias_correction: correct the moments for their zero start (see above).
        eps_inside_sqrt: use ``sqrt(v / c2 + eps)`` instead of ``sqrt(v / c2) + eps``.
        max_grad_norm: must be 0; clip with the ``gradient_clipping`` config key.
        var_freeze_step: the last step that may update the variance (>= 1).
        var_update_scaler: variance steps between doublings of ``var_interval`` (>= 1).
        local_step_scaler: frozen steps between doublings of ``local_step_interval`` (>= 1).
        local_step_clipper: the largest ``local_step_interval`` (>= 1).
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
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ):
        del deepspeed
        name = type(self).__name__
        check_adam_arguments(name, amsgrad=amsgrad, lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        check_freeze_step(name, "var_freeze_step", var_freeze_step)
        for key, value in (
            ("var_update_scaler", var_update_scaler),
            ("local_step_scaler", local_step_scaler),
            ("local_step_clipper", local_step_clipper),
        ):
            _check_count(name, key, value)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "eps_inside_sqrt": eps_inside_sqrt,
        }
        super().__init__(
            params, defaults, comm_backend_name=comm_backend_name, cuda_aware=cuda_aware, max_grad_norm=max_grad_norm
        )
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper

    # -- the schedule -----------------------------------------------------------------------

    def _schedule(self) -> dict:
        """The schedule's counters (the same in every parameter's state)."""
        for p in self._params():
            if "var_interval" in self.state[p]:
                return self.state[p]
        return {"var_interval": 1, "local_step_interval": 1}

    def updates_variance(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is a variance step on full-precision gradients."""
        return step <= self.var_freeze_step and step % self._schedule()["var_interval"] == 0

    def synchronises(self, step: int) -> bool:
        """Whether frozen step ``step`` ends with the compressed exchange of the update."""
        return step > self.var_freeze_step and step % self._schedule()["local_step_interval"] == 0

    def averages_gradients_itself(self) -> bool:
        """False only for the coming step if it is a variance step (the engine averages its
        gradients in full precision); every other step keeps the gradients local."""
        return not self.updates_variance(self.steps_taken() + 1)

    # -- the step -----------------------------------------------------------------------------

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state.update(
                step=torch.tensor(0.0),
                exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
                var_interval=1,
                var_counter=0,
                var_updates=0,
                local_step_interval=1,
                local_step_counter=0,
            )
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """Take the schedule's next step; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.steps_taken() + 1
        full, sync = self.updates_variance(step), self.synchronises(step)
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                work.append((group, p, self._state(p), grad))
        if step <= self.var_freeze_step:
            self._warm_up_step(work, full=full)
        else:
            self._local_step(work, step, sync=sync)
        return loss

    def _balanced_average_(self, work: list, tensors: list[torch.Tensor], *, tag: str) -> None:
        """The compressed average of ``tensors`` (one per parameter of ``work``), each
        scaled for the exchange by the mean over parameters of ``rms(sqrt(v))`` over its own.

        [Note: balancing the parameters in one exchange]
        The exchange sends one scale per chunk of the concatenated parameters, so a tensor
        of small values sharing a chunk with one of large values would come back as the
        chunk's scale, which the division by the small ``sqrt(v) + eps`` then magnifies.
        DeepSpeed exchanged each parameter separately (two collectives per parameter);
        here the tensors are brought to one scale instead, like 1-bit LAMB's
        ``scaling_coeff``, from the variance, which is the same on every rank.
        """
        variances = [state["exp_avg_sq"] for _, _, state, _ in work]
        params = [p for _, p, _, _ in work]
        rms = torch.stack(
            [
                n.float() / v.numel() ** 0.5
                for n, v in zip(torch._foreach_norm(torch._foreach_sqrt(variances)), variances)
            ]
        )
        # the mean within each exchange (see [Note: copies on several model-parallel ranks])
        keys = self.exchange_keys(params)
        means = {key: rms[[i for i, k in enumerate(keys) if k == key]].mean() for key in set(keys)}
        mean = torch.stack([means[k] for k in keys])
        scales = torch.where(rms > 0, mean / rms, torch.ones_like(rms))
        scales = [s.to(t.dtype) for s, t in zip(scales.unbind(), tensors)]
        torch._foreach_mul_(tensors, scales)
        self.compressed_average_(tensors, tag=tag, params=params)
        torch._foreach_div_(tensors, scales)
        for (group, _, state, _), tensor in zip(work, tensors):
            self.mask_unmeasured_(group, tensor, state["exp_avg_sq"])

    def _warm_up_step(self, work: list, *, full: bool) -> None:
        if not full:
            self._balanced_average_(work, [grad for _, _, _, grad in work], tag="gradients")
        for group, p, state, grad in work:
            beta1, beta2 = group["betas"]
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["step"] += 1
            if full:
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["var_updates"] += 1
                state["var_counter"] += 1
                if state["var_counter"] == self.var_update_scaler:
                    state["var_counter"] = 0
                    state["var_interval"] *= 2
            c1, denom = self._corrections(group, state)
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / c1)

    def _local_step(self, work: list, step: int, *, sync: bool) -> None:
        if "param_at_sync" not in work[0][2]:
            # the buffers hold what compressing gradients lost, which has no meaning for
            # the accumulated updates exchanged from now on
            self.reset_error_feedback()
            self._pending_rank_state = None
            comm = self.communicator()
            if comm is None or comm.rank == 0:
                logger.info(
                    "%s: the variance is frozen after %d steps; local steps from now on, synchronised 1-bit compressed",
                    type(self).__name__,
                    self.var_freeze_step,
                )
            for _, p, state, _ in work:
                state.update(param_at_sync=p.detach().clone(), lrs=0.0, decay=1.0)
        denoms = []
        for group, p, state, grad in work:
            state["exp_avg"].lerp_(grad, 1 - group["betas"][0])
            state["step"] += 1
            c1, denom = self._corrections(group, state)
            lr, weight_decay = group["lr"], group["weight_decay"]
            if weight_decay:
                p.mul_(1 - lr * weight_decay)
                state["decay"] *= 1 - lr * weight_decay
            p.addcdiv_(state["exp_avg"], denom, value=-lr / c1)
            state["lrs"] += lr
            state["local_step_counter"] += 1
            if state["local_step_counter"] == self.local_step_scaler:
                state["local_step_counter"] = 0
                state["local_step_interval"] = min(self.local_step_clipper, 2 * state["local_step_interval"])
            denoms.append((c1, denom))
        if sync:
            self._synchronise(work, denoms)

    def _synchronise(self, work: list, denoms: list) -> None:
        """Average the update accumulated since the last synchronisation (scaled by the
        frozen denominator), reset the momentum from it and re-apply it on every rank."""
        accumulated = [p.detach() - state["param_at_sync"] * state["decay"] for _, p, state, _ in work]
        torch._foreach_mul_(accumulated, [denom for _, denom in denoms])
        self._balanced_average_(work, accumulated, tag="accumulated update")
        for (_, p, state, _), (c1, denom), update in zip(work, denoms, accumulated):
            lrs = state["lrs"]
            if lrs > 0:
                # the lr-weighted mean of the corrected momenta, stored uncorrected
                torch.mul(update, -c1 / lrs, out=state["exp_avg"])
            p.copy_(state["param_at_sync"] * state["decay"]).addcdiv_(update, denom)
            state["param_at_sync"].copy_(p)
            state.update(lrs=0.0, decay=1.0)

    def _corrections(self, group: dict, state: dict) -> tuple[float, torch.Tensor]:
        """``c1`` and the denominator ``sqrt(v / c2) + eps`` of the coming update."""
        beta1, beta2 = group["betas"]
        c1 = c2 = 1.0
        if group["bias_correction"]:
            c1 = 1 - beta1 ** int(state["step"])
            c2 = 1 - beta2 ** state["var_updates"] if state["var_updates"] else 1.0
        if group["eps_inside_sqrt"]:
            return c1, (state["exp_avg_sq"] / c2).add_(group["eps"]).sqrt_()
        return c1, (state["exp_avg_sq"].sqrt() / c2**0.5).add_(group["eps"])
