"""DeepSpeed's ``DeepSpeedCPUAdagrad`` on torch's Adagrad (no compiled kernel)."""

from __future__ import annotations

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """Adagrad stepping on the CPU, with DeepSpeed's constructor.

    Args:
        model_params: parameters or param-group dicts.
        lr, eps, weight_decay: as torch.optim.Adagrad.
        amsgrad: must be False (Adagrad has no AMSGrad variant).
        fp32_optimizer_states: must be True (states take the parameters' dtype).
    """

    def __init__(
        self,
        model_params,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ):
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True) is not supported: Adagrad has no AMSGrad variant")
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdagrad(fp32_optimizer_states=False) is not supported")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


__all__ = ["DeepSpeedCPUAdagrad"]
