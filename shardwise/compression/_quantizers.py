"""Fake quantization and top-k masks with straight-through gradients.

Each function returns values on the quantized grid (or a 0/1 mask) in the forward and
passes the incoming gradient through unchanged in the backward (the straight-through
estimator of quantization-aware training). They are ``autograd.Function``s rather than
``x + (q - x).detach()``, whose forward is ``q`` only up to rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """How a tensor is fake-quantized."""

    bits: int
    """Bits per value: >= 3 a uniform grid of 2**bits levels, 2 ternary, 1 binary."""
    groups: int = 1
    """The tensor is split into this many equal, contiguous groups, each with its own scale
    (rows of a weight when it equals ``out_features``; tokens for activations)."""
    symmetric: bool = True
    """Symmetric: a grid around zero scaled by the largest magnitude. Asymmetric: a grid
    from the group's minimum to its maximum, with a rounded zero point."""
    stochastic: bool = False
    """Round stochastically (add uniform noise in [-0.5, 0.5) before rounding)."""


def _uniform(flat: torch.Tensor, spec: QuantSpec, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """``flat`` (groups x n) on the 2**bits grid spanning each group's [low, high]."""
    levels = 2**spec.bits
    noise = torch.empty_like(flat).uniform_(-0.5, 0.5) if spec.stochastic else 0.0
    tiny = torch.finfo(flat.dtype).tiny
    if spec.symmetric:
        scale = (2 * torch.maximum(low.abs(), high.abs()) / levels).clamp_min(tiny)
        return (flat / scale + noise).round().clamp(-levels // 2, levels // 2 - 1) * scale
    scale = ((high - low) / levels).clamp_min(tiny)
    zero = (low / scale).round() * scale
    return ((flat - zero) / scale + noise).round().clamp(0, levels - 1) * scale + zero


def symmetric_ints(flat: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of the symmetric ``bits`` grid of each row of ``flat`` (groups x n):
    ``q * scale`` is what :func:`quantize_values` gives with nearest rounding, and ``q``
    (int8) takes at most ``2**bits`` values, from ``-2**(bits-1)`` to ``2**(bits-1) - 1``.
    The int8 kernels of ``init_inference`` multiply these integers."""
    levels = 2**bits
    scale = (2 * flat.abs().amax(dim=1, keepdim=True) / levels).clamp_min(torch.finfo(flat.dtype).tiny)
    q = (flat / scale).round().clamp(-levels // 2, levels // 2 - 1)
    return q.to(torch.int8), scale


def _ternary(flat: torch.Tensor) -> torch.Tensor:
    # values beyond 0.7 x the mean magnitude become +-alpha, the mean magnitude of those values
    threshold = 0.7 * flat.abs().mean(dim=1, keepdim=True)
    kept = (flat.abs() > threshold).to(flat.dtype)
    alpha = (kept * flat).abs().sum(dim=1, keepdim=True) / kept.sum(dim=1, keepdim=True).clamp_min(1)
    return alpha * torch.sign(flat) * kept


def _binary(flat: torch.Tensor) -> torch.Tensor:
    return flat.sign() * flat.abs().mean(dim=1, keepdim=True)


def quantize_values(tensor: torch.Tensor, spec: QuantSpec, value_range=None) -> torch.Tensor:
    """``tensor`` on its quantization grid (no gradient rule; see :func:`fake_quantize`).
    ``value_range``: a fixed (low, high) for the whole tensor (static activation ranges);
    None: each group's own minimum and maximum.

    Raises:
        ValueError: ``spec.groups`` does not divide the tensor's element count.
    """
    if tensor.numel() % spec.groups:
        raise ValueError(f"quantize_groups={spec.groups} does not divide a tensor of {tensor.numel()} elements")
    flat = tensor.reshape(spec.groups, -1)
    if spec.bits >= 3:
        if value_range is None:
            low, high = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
        else:
            low, high = value_range
        out = _uniform(flat, spec, low, high)
    elif spec.bits == 2:
        out = _ternary(flat)
    else:
        out = _binary(flat)
    return out.reshape(tensor.shape)


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, spec, value_range):
        return quantize_values(tensor, spec, value_range)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def fake_quantize(tensor: torch.Tensor, spec: QuantSpec, value_range=None) -> torch.Tensor:
    """``tensor`` quantized as ``spec`` says (see :func:`quantize_values`), with a
    straight-through gradient."""
    return _FakeQuantize.apply(tensor, spec, value_range)


def topk_mask_values(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """A 0/1 tensor shaped like ``scores`` with ones at its ceil(ratio x numel) largest
    entries (ties broken by position)."""
    keep = math.ceil(ratio * scores.numel())
    order = scores.flatten().argsort(descending=True, stable=True)
    mask = torch.zeros(scores.numel(), dtype=scores.dtype, device=scores.device)
    mask[order[:keep]] = 1
    return mask.view(scores.shape)


class _TopKMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, ratio):
        return topk_mask_values(scores, ratio)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def topk_mask(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """:func:`topk_mask_values` whose gradient reaches ``scores`` unchanged (learned masks)."""
    return _TopKMask.apply(scores, ratio)
