"""Weight-only int8: the linear layers' weights stored as int8 with one symmetric scale
per output channel, dequantised on the fly.

A weight ``W`` (``[out, in]``) becomes ``q = round(W / s)`` with ``s = max|W[o, :]| / 127``
per output row ``o``; reading ``module.weight`` gives ``q * s`` in the activation dtype
(a ``torch.nn.utils.parametrize`` parametrization), so every layer type that reads its
``weight`` (``nn.Linear``, Hugging Face ``Conv1D`` with its ``[in, out]`` weight, the
tensor-parallel layers) keeps its own forward and communication. At rest a layer holds a
quarter of its float32 bytes (half of float16) plus one scale per output feature.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize


class Int8Weight(nn.Module):
    """The parametrization: int8 ``original`` -> ``original * scale`` in ``dtype``."""

    def __init__(self, scale: torch.Tensor, *, out_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("scale", scale)
        self.out_dim = out_dim
        self.dtype = dtype

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        scale = self.scale.to(self.dtype)
        return q.to(self.dtype) * (scale[:, None] if self.out_dim == 0 else scale[None, :])


def quantize_weight(weight: torch.Tensor, *, out_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 weight, float32 scale per output channel)`` of a float weight whose output
    channels lie along ``out_dim``."""
    w = weight.detach().float()
    reduce_dim = 1 - out_dim
    scale = w.abs().amax(dim=reduce_dim).clamp(min=1e-12) / 127.0
    shaped = scale[:, None] if out_dim == 0 else scale[None, :]
    q = torch.round(w / shaped).clamp(-127, 127).to(torch.int8)
    return q, scale


def int8_parts(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(int8 weight, scale)`` of a quantised layer (weight in the layer's own layout), or
    None for a layer with a float weight."""
    if not parametrize.is_parametrized(module, "weight"):
        return None
    for p in module.parametrizations.weight:
        if isinstance(p, Int8Weight):
            return module.parametrizations.weight.original, p.scale
    return None


def quantize_linears(model: nn.Module, *, dtype: torch.dtype, skip: tuple[nn.Module, ...] = ()) -> dict[str, int]:
    """Store every linear layer's weight of ``model`` as int8 (see the module docstring),
    except the layers in ``skip`` (the LM head, whose error every logit would carry).

    Returns ``{"layers": n, "bytes_before": b0, "bytes_after": b1}`` over the weights
    quantised.

    Raises:
        ValueError: the model has no linear layer.
    """
    layers, before, after = 0, 0, 0
    for module in model.modules():
        is_conv1d = type(module).__name__ == "Conv1D"
        weight = getattr(module, "weight", None)
        if module in skip or not (isinstance(module, nn.Linear) or is_conv1d or _is_parallel_linear(module)):
            continue
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or int8_parts(module) is not None:
            continue
        out_dim = 1 if is_conv1d else 0
        q, scale = quantize_weight(weight, out_dim=out_dim)
        before += weight.numel() * weight.element_size()
        after += q.numel() + scale.numel() * scale.element_size()
        marks = dict(vars(weight))  # tensor-parallel shard marks
        module.weight = nn.Parameter(q, requires_grad=False)
        for key, value in marks.items():
            setattr(module.weight, key, value)
        parametrize.register_parametrization(
            module, "weight", Int8Weight(scale, out_dim=out_dim, dtype=dtype), unsafe=True
        )
        layers += 1
    if not layers:
        raise ValueError(
            f"dtype=torch.int8 quantises linear layers' weights, but {type(model).__name__} has no "
            "nn.Linear, Conv1D or tensor-parallel linear layer; use a floating-point dtype"
        )
    return {"layers": layers, "bytes_before": before, "bytes_after": after}


def _is_parallel_linear(module: nn.Module) -> bool:
    from shardwise.tensor_parallel.layers import _ParallelLinear

    return isinstance(module, _ParallelLinear)
