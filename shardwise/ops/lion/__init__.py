"""DeepSpeed's Lion optimizer names, on shardwise's multi-tensor Lion (no compiled kernel)."""

from __future__ import annotations

from shardwise.optim.lion import Lion


class DeepSpeedCPULion(Lion):
    """Lion stepping on the CPU (for optimizer state offloaded there).

    Args:
        model_params: parameters or param-group dicts.
        lr, betas, weight_decay: as :class:`shardwise.optim.Lion`.
        fp32_optimizer_states: must be True (states take the parameters' dtype, fp32 for
            offloaded masters).
    """

    def __init__(
        self,
        model_params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ):
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPULion(fp32_optimizer_states=False) is not supported")
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


class FusedLion(Lion):
    """DeepSpeed's ``FusedLion`` signature (``set_grad_none`` accepted)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ):
        del set_grad_none
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)


__all__ = ["DeepSpeedCPULion", "FusedLion"]
