"""LAMB: Adam with a per-parameter trust ratio (You et al., 2019, arXiv:1904.00962)."""

from __future__ import annotations

import torch


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive Adam for large-batch training.

    Each parameter's Adam update ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w``
    is rescaled by the trust ratio ``||w|| / ||u||`` clamped to ``[min_coeff, max_coeff]``
    (1 when either norm is zero), then applied with the learning rate. Parameter names
    and defaults follow DeepSpeed's Lamb.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate.
        bias_correction: correct the moment estimates for their zero initialisation.
        betas: decay rates of the first and second moments.
        eps: added to the denominator for stability.
        weight_decay: decoupled weight decay folded into the update before the trust ratio.
        max_grad_norm: accepted for DeepSpeed compatibility; clip with gradient_clipping.
        max_coeff: upper bound of the trust ratio.
        min_coeff: lower bound of the trust ratio.
        amsgrad: not supported (DeepSpeed's Lamb refuses it too).
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False):
        if amsgrad:
            raise ValueError("Lamb does not support amsgrad=True; remove it from optimizer.params")
        if lr < 0 or eps <= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"invalid Lamb hyper-parameters: lr={lr}, eps={eps}, betas={betas}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)

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
            beta1, beta2 = group["betas"]
            for p in params:
                if not self.state[p]:
                    self.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                     "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            states = [self.state[p] for p in params]
            grads = [p.grad for p in params]
            exp_avg = [s["exp_avg"] for s in states]
            exp_avg_sq = [s["exp_avg_sq"] for s in states]
            torch._foreach_add_([s["step"] for s in states], 1.0)
            torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sq, beta2)
            torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
            step = float(states[0]["step"])
            c1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
            c2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
            denom = torch._foreach_sqrt(exp_avg_sq)
            torch._foreach_div_(denom, c2 ** 0.5)
            torch._foreach_add_(denom, group["eps"])
            updates = torch._foreach_div(exp_avg, denom)
            torch._foreach_div_(updates, c1)
            if group["weight_decay"]:
                torch._foreach_add_(updates, params, alpha=group["weight_decay"])
            w_norms = torch._foreach_norm(params)
            u_norms = torch._foreach_norm(updates)
            for p, u, wn, un in zip(params, updates, w_norms, u_norms):
                ratio = torch.where((wn > 0) & (un > 0), wn / un, torch.ones_like(wn))
                ratio = ratio.clamp(group["min_coeff"], group["max_coeff"])
                p.add_(u * ratio.to(u.dtype), alpha=-group["lr"])
        return loss
