"""Helpers over a model's module tree: dotted-name access and construction on a device.

``recursive_getattr`` / ``recursive_setattr`` are what DeepSpeed-Chat's LoRA code uses to
swap ``nn.Linear`` layers for LoRA layers by name; ``OnDevice`` builds a model's tensors
directly on a device (``"meta"``: no memory) in a floating dtype.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def recursive_getattr(model: nn.Module, module_name: str):
    """The attribute at dotted path ``module_name`` under ``model`` (``"layers.0.attn"``).

    Raises:
        AttributeError: a name along the path does not exist.
    """
    found = model
    for name in module_name.split("."):
        found = getattr(found, name)
    return found


def recursive_setattr(model: nn.Module, module_name: str, module) -> None:
    """Set the attribute at dotted path ``module_name`` under ``model`` to ``module``
    (the parents must exist; the last name is assigned, replacing a submodule in place)."""
    parent_name, _, leaf = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_name) if parent_name else model
    setattr(parent, leaf, module)


class OnDevice(contextlib.AbstractContextManager):
    """Build modules on ``device`` with floating tensors in ``dtype`` (DeepSpeed's
    ``deepspeed.OnDevice``)::

        with OnDevice(dtype=torch.bfloat16, device="meta"):
            model = MyModel()  # no memory: materialise with model.to_empty(device=...)

    Uses PyTorch's own device context (``with torch.device(...)``) and default dtype,
    restored on exit, rather than replacing ``torch.empty`` & co as DeepSpeed does: a
    constructor given an explicit ``device=`` or ``dtype=`` keeps it.

    Args:
        dtype: the floating dtype of new parameters and buffers (None: unchanged).
        device: where new tensors are created (default ``"meta"``).
        enabled: False makes the context do nothing.
    """

    def __init__(self, dtype: torch.dtype | None, device="meta", enabled: bool = True):
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"OnDevice(dtype=...) must be a floating dtype, got {dtype}")
        self.dtype, self.device, self.enabled = dtype, device, enabled
        self._device_context = None
        self._previous_dtype = None

    def __enter__(self):
        if self.enabled:
            self._device_context = torch.device(self.device)
            self._device_context.__enter__()
            if self.dtype is not None:
                self._previous_dtype = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc_info) -> None:
        if self._device_context is None:
            return
        if self._previous_dtype is not None:
            torch.set_default_dtype(self._previous_dtype)
            self._previous_dtype = None
        self._device_context.__exit__(*exc_info)
        self._device_context = None
