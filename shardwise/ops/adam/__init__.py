"""``DeepSpeedCPUAdam`` and ``FusedAdam`` with DeepSpeed's constructor signatures, built on
torch's fused Adam kernels (CPU and CUDA), which need no compiled extension."""

from __future__ import annotations

import torch


def _init_torch_adam(
    optimizer: torch.optim.Adam, name: str, params, *, bias_correction: bool, betas, decoupled: bool, **options
) -> None:
    """torch.optim.Adam with DeepSpeed's argument names, on torch's fused kernel when the
    tensors share one CPU or CUDA device (foreach otherwise)."""
    if not bias_correction:
        raise ValueError(f"{name}(bias_correction=False) is not supported: torch's Adam always corrects the moments")
    params = list(params)  # deciding the kernel needs the tensors; a generator is read once
    tensors = [t for item in params for t in (item["params"] if isinstance(item, dict) else [item])]
    devices = {t.device.type for t in tensors}
    kernel = {"fused": True} if len(devices) == 1 and devices <= {"cpu", "cuda"} else {"foreach": True}
    torch.optim.Adam.__init__(
        optimizer, params, betas=tuple(betas), decoupled_weight_decay=decoupled, **options, **kernel
    )


class DeepSpeedCPUAdam(torch.optim.Adam):
    """Adam/AdamW stepping on the CPU, for optimizer states offloaded to CPU memory.

    DeepSpeed compiles its own AVX kernel for this; torch's fused CPU kernel is
    vectorised and multi-threaded too (parameters/s side by side in
    ``bench/bench_cpu_adam.py``).

    Args:
        model_params: parameters or param-group dicts.
        lr, betas, eps, weight_decay, amsgrad: as torch.optim.Adam.
        bias_correction: must be True (torch always corrects the moments).
        adamw_mode: decoupled weight decay (AdamW) when True, L2 (Adam) when False.
        fp32_optimizer_states: must be True; states are kept in the parameters' dtype,
            which is fp32 for offloaded master weights.
    """

    def __init__(
        self,
        model_params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ):
        if not fp32_optimizer_states:
            raise ValueError(
                "DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported: states "
                "take the dtype of the parameters they update"
            )
        _init_torch_adam(
            self,
            "DeepSpeedCPUAdam",
            model_params,
            bias_correction=bias_correction,
            betas=betas,
            decoupled=adamw_mode,
            lr=lr,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
        )


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam`` signature on torch's fused Adam (CUDA or CPU).

    ``adam_w_mode`` picks decoupled weight decay (default, as DeepSpeed); ``set_grad_none``
    is accepted (``zero_grad`` sets gradients to None anyway)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ):
        del set_grad_none
        _init_torch_adam(
            self,
            "FusedAdam",
            params,
            bias_correction=bias_correction,
            betas=betas,
            decoupled=adam_w_mode,
            lr=lr,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
        )
