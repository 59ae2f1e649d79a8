"""Lion: sign-of-momentum updates (Chen et al., 2023, arXiv:2302.06675)."""

from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    """Lion with DeepSpeed's ``FusedLion`` / ``DeepSpeedCPULion`` arguments.

    Per parameter ``w`` with gradient ``g`` and momentum ``m`` (zeros at first), one step::

        w = w * (1 - lr * weight_decay)
        w = w - lr * sign(beta1 * m + (1 - beta1) * g)
        m = beta2 * m + (1 - beta2) * g

    State per parameter: ``exp_avg`` (like the parameter). Multi-tensor kernels per
    (device, dtype) group.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate (Lion wants 3-10x less than AdamW).
        betas: interpolation for the update direction, and momentum decay.
        weight_decay: decoupled weight decay.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr < 0:
            raise ValueError(f"Lion lr must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion betas must be in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            moms = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in params]
            beta1, beta2 = group["betas"]
            if group["weight_decay"] != 0:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            update = torch._foreach_mul(moms, beta1)
            torch._foreach_add_(update, grads, alpha=1 - beta1)
            torch._foreach_sign_(update)
            torch._foreach_add_(params, update, alpha=-group["lr"])
            torch._foreach_mul_(moms, beta2)
            torch._foreach_add_(moms, grads, alpha=1 - beta2)
        return loss
