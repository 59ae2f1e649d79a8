"""LAMB: Adam with a per-parameter trust ratio (You et al., 2019, arXiv:1904.00962)."""

from __future__ import annotations

from collections import defaultdict

import torch


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive Adam for large-batch training, with DeepSpeed FusedLamb's knobs.

    Per parameter ``w`` with gradient ``g``, one step does::

        m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
        u = (m / c1) / (sqrt(v / c2) + eps) + weight_decay * w
        w = w - lr * trust * u,   trust = clamp(||w|| / ||u||, min_coeff, max_coeff)

    where ``c1 = 1 - beta1**t`` and ``c2 = 1 - beta2**t`` (1 without bias correction),
    ``t`` counts this parameter's own steps, and ``trust = 1`` (unclamped) when either
    norm is zero. The trust ratio is per tensor, so a parameter must not be split across
    ranks when this optimizer runs on shards. State per parameter: ``step`` (0-dim fp32
    on CPU), ``exp_avg`` and ``exp_avg_sq`` (like the parameter). The update runs on
    multi-tensor (``torch._foreach_*``) kernels per (device, dtype) group.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate.
        bias_correction: correct the moment estimates for their zero initialisation.
        betas: decay rates of the first and second moments.
        eps: added to the denominator for stability.
        eps_inside_sqrt: use ``sqrt(v / c2 + eps)`` instead of ``sqrt(v / c2) + eps``.
        weight_decay: decoupled weight decay, folded into the update before the trust ratio.
        max_grad_norm: accepted for DeepSpeed compatibility and ignored; clip with the
            ``gradient_clipping`` config key instead.
        max_coeff: upper bound of the trust ratio.
        min_coeff: lower bound of the trust ratio.
        amsgrad: must be False (FusedLamb has no AMSGrad variant either).

    Raises:
        ValueError: ``amsgrad=True`` or an out-of-range hyper-parameter.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ):
        if amsgrad:
            raise ValueError("Lamb does not support amsgrad=True; remove it from optimizer.params")
        if lr < 0:
            raise ValueError(f"Lamb lr must be >= 0, got {lr}")
        if eps < 0:
            raise ValueError(f"Lamb eps must be >= 0, got {eps}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"Lamb betas must be in [0, 1), got {tuple(betas)}")
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb needs 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter that has a gradient; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                buckets[(p.device, p.dtype)].append(p)
            for params in buckets.values():
                self._update(group, params)
        return loss

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif not torch.is_tensor(state["step"]):  # a checkpoint that stored a plain number
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
        return state

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        """One LAMB step over ``params`` (same device and dtype, all with gradients)."""
        lamb_update_(group, params, [self._state(p) for p in params])


def lamb_update_(group: dict, params: list[torch.Tensor], states: list[dict]) -> tuple[torch.Tensor, ...]:
    """One LAMB step over ``params`` (same device and dtype, all with gradients) with the
    options of ``group`` and the per-parameter ``states`` (``step``, ``exp_avg``,
    ``exp_avg_sq``). Returns the trust ratios as computed (``clamped``), whether both norms
    were positive (``measured``) and the ratios applied (``trust``), one per parameter;
    1-bit LAMB's warm-up averages them."""
    beta1, beta2 = group["betas"]
    grads = [p.grad for p in params]
    exp_avg = [s["exp_avg"] for s in states]
    exp_avg_sq = [s["exp_avg_sq"] for s in states]
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1.0)
    torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)

    # Steps live on the CPU, so reading them does not synchronise the device.
    counts = [int(s.item()) for s in steps]
    if group["bias_correction"]:
        c1 = [1 - beta1**t for t in counts]
        c2 = [1 - beta2**t for t in counts]
    else:
        c1 = c2 = [1.0] * len(params)
    denom = torch._foreach_div(exp_avg_sq, c2)
    if group["eps_inside_sqrt"]:
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_sqrt_(denom)
    else:
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
    updates = torch._foreach_div(exp_avg, c1)
    torch._foreach_div_(updates, denom)
    del denom
    if group["weight_decay"]:
        torch._foreach_add_(updates, params, alpha=group["weight_decay"])

    w_norms = torch.stack(torch._foreach_norm(params)).float()
    u_norms = torch.stack(torch._foreach_norm(updates)).float()
    clamped = (w_norms / u_norms).clamp(group["min_coeff"], group["max_coeff"])
    measured = (w_norms > 0) & (u_norms > 0)
    trust = torch.where(measured, clamped, torch.ones_like(clamped))
    torch._foreach_mul_(updates, [r.to(u.dtype) for r, u in zip(trust.unbind(), updates)])
    torch._foreach_add_(params, updates, alpha=-group["lr"])
    return clamped, measured, trust
