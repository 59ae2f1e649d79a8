"""ZeroQuant layers on int8 kernels: ``init_inference(model, dtype=torch.int8)`` replaces
each :class:`~shardwise.compression._layers.CompressedLinear` that quantizes its weight to
8 bits or fewer (symmetric) and its input per token to 8 bits (dynamic, symmetric) by an
:class:`Int8DynamicLinear`, which holds the weight's integers and never rebuilds a float
weight.

[Note: int8 kernel arithmetic]
The compressed layer computes ``(qx * sx) @ (qw * sw).T`` in float: ``qx`` the token's
integers on the 8-bit grid with one scale ``sx`` per token, ``qw`` the weight's integers
with one scale ``sw`` per group of input columns of each row (``quantize_groups`` groups
of the flattened weight: with ``g * out_features`` groups, each row has ``g`` groups of
``in_features / g`` columns; with fewer groups than rows, rows share a scale). The kernel
layer computes the same sum in integers, ``sum over groups of (qx_g @ qw_g.T) * sw_g``
scaled by ``sx``, through torchao's ``int_scaled_matmul`` (int8 x int8 -> int32 with the
per-token scale applied; what torchao's own int8 dynamic quantization calls on CPU), so
the two differ only by float rounding of the scaling. 4-bit weights run on the same
kernel (their integers fit int8) and take one byte each.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardwise.compression._layers import CompressedLinear
from shardwise.compression._quantizers import symmetric_ints

logger = logging.getLogger("shardwise")

INSTALL_HINT = "pip install 'shardwise[quant]' (torchao)"


def _scaled_matmul():
    """torchao's ``int_scaled_matmul``, imported once with its log lines about optional
    GPU extensions kept quiet.

    Raises:
        ImportError: torchao is not installed, naming the extra to install.
    """
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torchao.kernel.intmm import int_scaled_matmul
    except ImportError as error:
        raise ImportError(
            "init_inference(dtype=torch.int8) runs ZeroQuant layers (weight and activation quantization) on "
            f"torchao's int8 kernels, and torchao is not importable ({error}); install it with {INSTALL_HINT}"
        ) from None
    finally:
        quiet.setLevel(level)
    return int_scaled_matmul


class Int8DynamicLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored as int8 integers and group scales and ``x``
    quantized per token to int8 at every call (see [Note: int8 kernel arithmetic])."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, *, weight_bits: int):
        super().__init__()
        num_groups, out_features, group_cols = qweight.shape
        self.in_features = num_groups * group_cols
        self.out_features = out_features
        self.weight_bits = weight_bits
        self.register_buffer("qweight", qweight)
        """int8, ``[groups, out_features, in_features / groups]``: each group's columns."""
        self.register_buffer("weight_scale", scale)
        """float32, ``[groups, out_features]``."""
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._matmul = _scaled_matmul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features).float()
        qx, sx = symmetric_ints(flat, 8)
        out = None
        cols = self.qweight.shape[2]
        for g in range(self.qweight.shape[0]):
            part = qx if self.qweight.shape[0] == 1 else qx[:, g * cols : (g + 1) * cols].contiguous()
            y = self._matmul(part, self.qweight[g].t(), sx) * self.weight_scale[g]
            out = y if out is None else out.add_(y)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        groups = self.qweight.shape[0]
        return f"in_features={self.in_features}, out_features={self.out_features}, W{self.weight_bits}A8, {groups=}"


def kernel_problem(layer: CompressedLinear) -> str | None:
    """Why ``layer`` cannot run on the int8 kernel, or None when it can."""
    weights, acts = layer.weight_quantization, layer.activation_quantization
    if weights is None or layer.current_bits() is None:
        return "its weight is not quantized (or not yet, by its schedule)"
    bits = layer.current_bits()
    if bits < 3 or not weights.grid.symmetric or weights.grid.stochastic:
        kind = "symmetric" if weights.grid.symmetric else "asymmetric"
        return f"its weights are {bits}-bit {kind}; the kernel takes 3-8-bit symmetric weights, nearest rounding"
    if acts is None or acts.static or not acts.symmetric or acts.bits != 8 or layer.step < acts.offset:
        return "its input is not quantized per token to 8 bits (activation_quantization dynamic, symmetric, bits 8)"
    if any(p is not None for p in (layer.sparse_pruning, layer.row_pruning, layer.head_pruning)):
        return "it still holds pruning masks; fold them in with redundancy_clean first"
    groups = weights.grid.groups
    rows, cols = layer.weight.shape
    if not (groups % rows == 0 and cols % (groups // rows) == 0) and rows % groups:
        return f"quantize_groups={groups} splits rows of its {rows}x{cols} weight unevenly"
    return None


@torch.no_grad()
def int_weight(layer: CompressedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight [groups, out, cols], scale [groups, out])`` of a layer the kernel takes:
    the integers and scales its fake-quantized forward multiplies by."""
    rows, cols = layer.weight.shape
    groups = layer.weight_quantization.grid.groups
    q, scale = symmetric_ints(layer.weight.detach().float().reshape(groups, -1), layer.current_bits())
    per_row = max(groups // rows, 1)
    q = q.reshape(rows, per_row, cols // per_row).permute(1, 0, 2).contiguous()
    scale = scale.reshape(-1).repeat_interleave(max(rows // groups, 1)).reshape(rows, per_row).t().contiguous()
    return q, scale


def pack_int8_layers(model: nn.Module) -> dict[str, int]:
    """Replace the ZeroQuant layers of ``model`` by :class:`Int8DynamicLinear` (see the
    module docstring); compressed layers the kernel cannot take keep their own forward,
    with one warning naming them and why.

    Returns:
        ``{"layers", "bytes_before", "bytes_after"}`` over the layers replaced.

    Raises:
        ImportError: torchao is missing and the model has layers to replace.
    """
    from shardwise.utils._modules import recursive_setattr

    found = [(name, m) for name, m in model.named_modules() if isinstance(m, CompressedLinear)]
    ready = [(name, m) for name, m in found if kernel_problem(m) is None]
    skipped = [f"{name} ({kernel_problem(m)})" for name, m in found if kernel_problem(m) is not None]
    if skipped:
        logger.warning(
            "init_inference(dtype=torch.int8): %d compressed layer(s) keep their float forward: %s",
            len(skipped),
            "; ".join(skipped[:4]) + ("..." if len(skipped) > 4 else ""),
        )
    before = after = 0
    for name, layer in ready:
        q, scale = int_weight(layer)
        bias = layer.bias.detach().float() if layer.bias is not None else None
        kernel = Int8DynamicLinear(q, scale, bias, weight_bits=layer.current_bits())
        before += layer.weight.numel() * layer.weight.element_size()
        after += q.numel() + scale.numel() * scale.element_size()
        recursive_setattr(model, name, kernel.to(layer.weight.device))
    return {"layers": len(ready), "bytes_before": before, "bytes_after": after}
