"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters`` names.

``Init``, ``GatheredParameters`` and ``register_external_parameter`` are shardwise's
(``shardwise.zero``). ``ZeroParamStatus`` names a stage-3 parameter's state.
``zero_wrapper_for_fp_tensor_constructor`` is DeepSpeed's hook for tensor constructors
under ``zero.Init``; shardwise's ``Init`` leaves constructors alone (it never changes
the dtype of tensors a module builds), so patching it, as Hugging Face's
``prevent_arange_dtype_change`` does, changes nothing.
"""

from __future__ import annotations

import functools

import torch

from shardwise.accelerator import get_accelerator
from shardwise.zero import GatheredParameters, Init, register_external_parameter
from shardwise.zero._unit import ZeroParamStatus

_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype: torch.dtype, target_device=None):
    """``fn`` (a tensor constructor) whose floating-point results are made in
    ``target_fp_dtype`` on ``target_device`` (default: this rank's device)."""
    device = target_device if target_device is not None else get_accelerator().device()

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        kwargs.setdefault("device", device)
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped


__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]
