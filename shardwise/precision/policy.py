"""Which dtype the model computes in and whether an fp32 master copy is kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of one training run.

    ``param_dtype`` is what the module's parameters, activations and gradients use;
    optimizer updates always happen in fp32 (``master_dtype``), on a separate master copy
    when ``param_dtype`` is lower precision.
    """

    param_dtype: torch.dtype = torch.float32
    loss_scaling: bool = False
    """Whether the loss is scaled before backward (fp16 only)."""
    auto_cast_inputs: bool = False
    """Cast floating-point forward inputs to ``param_dtype`` (``fp16.auto_cast``)."""
    master_dtype: torch.dtype = torch.float32
    skip_nonfinite: bool = False
    """Skip (not apply) an optimizer step whose gradient norm is inf/nan: always with fp16
    loss scaling, with bf16 unless ``bf16.check_grad_overflow`` is false (as DeepSpeed)."""

    @property
    def needs_master_copy(self) -> bool:
        return self.param_dtype != self.master_dtype

    @classmethod
    def from_config(cls, config) -> PrecisionPolicy:
        """Read ``fp16`` / ``bf16`` from a TrainConfig."""
        if config.fp16.enabled:
            return cls(torch.float16, loss_scaling=True, auto_cast_inputs=config.fp16.auto_cast, skip_nonfinite=True)
        if config.bf16.enabled:
            return cls(torch.bfloat16, skip_nonfinite=config.bf16.check_grad_overflow)
        return cls()

    def cast_inputs(self, value):
        """Cast floating tensors in (nested) forward inputs to ``param_dtype``."""
        if not self.auto_cast_inputs:
            return value
        if isinstance(value, torch.Tensor):
            return value.to(self.param_dtype) if value.is_floating_point() else value
        if isinstance(value, (list, tuple)):
            return type(value)(self.cast_inputs(v) for v in value)
        if isinstance(value, dict):
            return {k: self.cast_inputs(v) for k, v in value.items()}
        return value
