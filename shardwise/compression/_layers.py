"""``CompressedLinear``: an ``nn.Linear`` that applies the enabled compression techniques in
its forward (DeepSpeed's ``LinearLayer_Compress``).

[Note: compression schedule]
Every technique has a ``schedule_offset``: the forward of training step ``t`` (``t`` optimizer
steps done) applies it when ``t >= schedule_offset``, as DeepSpeed's compression scheduler
did. Weight bits follow DeepSpeed's MoQ schedule: its quantizer ran once in the first
forward when the offset is 0 and once after every optimizer step from the offset on; each
run at which the run count reached the period dropped one bit (from ``start_bits`` down to
``target_bits``) and doubled the period. :func:`weight_bits` replays that count, so a layer's
state is a pure function of the step (:meth:`CompressedLinear.set_step`) and a checkpoint
only needs the step. With ``quantize_weight_in_forward`` DeepSpeed used ``target_bits`` from
the offset on, and so does this layer. Unlike MoQ, which overwrote the weights after each
step, the layer keeps full-precision weights and quantizes them in the forward, with
straight-through gradients (QAT).

Masks: l1 masks are computed once, from the weights when the technique is enabled
(``init_compression``), and kept as buffers; topk masks are the top entries of learned
scores (parameters trained through the straight-through mask), recomputed every forward;
snip_momentum masks are buffers recomputed at its pruning steps (see [Note: snip_momentum
schedule] in ``_snip_momentum.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.compression._quantizers import QuantSpec, fake_quantize, topk_mask, topk_mask_values


@dataclass(frozen=True, kw_only=True)
class WeightQuantization:
    """A layer's weight-quantization settings (one group's params with the shared ones)."""

    start_bits: int
    target_bits: int
    period: int
    offset: int
    in_forward: bool
    grid: QuantSpec
    """Groups, symmetry and rounding (its ``bits`` is replaced by the scheduled bits)."""


@dataclass(frozen=True, kw_only=True)
class Pruning:
    """A pruning technique's settings on one layer."""

    method: str
    """``l1`` (fixed mask from the weights), ``topk`` (learned scores) or, for sparse
    pruning, ``snip_momentum`` (a mask recomputed at its pruning steps)."""
    ratio: float
    """The fraction kept (``dense_ratio``)."""
    offset: int
    num_heads: int = 0
    """Head pruning: the attention heads the layer's input is made of."""
    schedule: object = None
    """snip_momentum: its ``SnipSchedule`` (see [Note: snip_momentum schedule])."""


@dataclass(frozen=True, kw_only=True)
class ActivationQuantization:
    bits: int
    symmetric: bool
    static: bool
    """Static: one range for all tokens, a running min/max; dynamic: one range per token."""
    offset: int
    momentum: float = 0.95


def weight_bits(spec: WeightQuantization, step: int) -> int | None:
    """The bits the forward of training step ``step`` uses (None: not quantized yet); see
    [Note: compression schedule]."""
    if spec.in_forward:
        return spec.target_bits if step >= spec.offset else None
    runs = max(0, step - spec.offset) + (1 if spec.offset == 0 else 0)
    if runs == 0:
        return None
    # the k-th drop happens at run period * 2**(k - 1): the period doubles after each drop
    bits, at_run = spec.start_bits, spec.period
    while bits > spec.target_bits and runs >= at_run:
        bits, at_run = bits - 1, at_run * 2
    return bits


class _CompressedWeight:
    """What a compressed layer does with its ``weight`` whatever its kind (linear,
    convolution): the bit schedule of weight quantization and the masks of the pruning
    techniques, each an ``l1`` buffer fixed when enabled, the top-k of learned scores, or
    snip_momentum's buffer recomputed at its pruning steps."""

    weight: torch.Tensor
    weight_quantization: WeightQuantization | None
    sparse_pruning: Pruning | None
    step: int
    _bits: int | None

    def enable_weight_quantization(self, spec: WeightQuantization) -> None:
        if self.weight.numel() % spec.grid.groups:
            raise ValueError(
                f"quantize_groups={spec.grid.groups} does not divide the {tuple(self.weight.shape)} weight"
            )
        self.weight_quantization = spec
        self.set_step(self.step)

    def set_step(self, step: int) -> None:
        """Apply the techniques the forward of training step ``step`` uses."""
        self.step = step
        spec = self.weight_quantization
        self._bits = weight_bits(spec, step) if spec is not None else None

    def current_bits(self) -> int | None:
        """The weight bits of the next forward (None: full precision)."""
        return self._bits

    def _add_mask(self, names: tuple[str, str], spec: Pruning, norms: torch.Tensor, shape) -> None:
        """``l1``: buffer ``names[0]`` keeps the largest ``norms`` now; ``topk``: parameter
        ``names[1]`` holds learned scores of ``shape``."""
        mask_name, scores_name = names
        if spec.method == "l1":
            mask = topk_mask_values(norms.float(), spec.ratio).to(self.weight.dtype)
            self.register_buffer(mask_name, mask.view(shape))
        else:
            scores = torch.empty(shape, device=self.weight.device, dtype=self.weight.dtype)
            nn.init.kaiming_uniform_(scores, a=5**0.5)
            setattr(self, scores_name, nn.Parameter(scores))

    def _enable_snip_momentum(self) -> None:
        """A mask buffer recomputed at the pruning steps, a score buffer, and a hook that
        collects the weight's gradients (see [Note: snip_momentum schedule])."""
        self.register_buffer("sparse_pruning_mask", torch.ones_like(self.weight, requires_grad=False))
        self.register_buffer("sparse_snip_scores", torch.zeros_like(self.weight, dtype=torch.float32))
        self.snip_grad: torch.Tensor | None = None
        self.snip_hook = self.weight.register_hook(self._collect_snip_grad)

    def _collect_snip_grad(self, grad: torch.Tensor) -> None:
        """The weight's gradients of this step (every micro-batch's, before any reduction or
        ZeRO bucketing), summed for the snip_momentum score while a pruning step is ahead."""
        if self.step >= self.sparse_pruning.schedule.last_prune:
            return
        grad = grad.detach().float()
        self.snip_grad = grad.clone() if self.snip_grad is None else self.snip_grad.add_(grad)

    def _mask(self, spec: Pruning, names: tuple[str, str]) -> torch.Tensor:
        """The mask ``_add_mask`` set up under ``names`` (a buffer unless ``topk``)."""
        if spec.method != "topk":
            return getattr(self, names[0])
        return topk_mask(getattr(self, names[1]), spec.ratio)


_SPARSE = ("sparse_pruning_mask", "sparse_mask_scores")
_ROW = ("row_pruning_mask", "row_mask_scores")


class CompressedLinear(_CompressedWeight, nn.Linear):
    """A linear layer whose forward applies weight quantization, sparse / row / head pruning
    and activation quantization as enabled (see [Note: compression schedule]). Mask and score
    names are DeepSpeed's, so state dicts match."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight_quantization: WeightQuantization | None = None
        self.sparse_pruning: Pruning | None = None
        self.row_pruning: Pruning | None = None
        self.head_pruning: Pruning | None = None
        self.activation_quantization: ActivationQuantization | None = None
        self.step = 0
        self._bits: int | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> CompressedLinear:
        """A compressed layer holding ``linear``'s own parameters (not copies).

        Raises:
            ValueError: ``linear`` is a subclass of ``nn.Linear`` (its own forward would be lost).
        """
        if isinstance(linear, CompressedLinear):
            return linear
        if type(linear) is not nn.Linear:
            raise ValueError(
                f"{type(linear).__name__} is a subclass of nn.Linear with its own behaviour, which a "
                "compressed layer would drop; only plain nn.Linear layers are compressed"
            )
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.train(linear.training)
        return layer

    def enable_activation_quantization(self, spec: ActivationQuantization) -> None:
        self.activation_quantization = spec
        if spec.static:
            self.register_buffer("x_min_max", torch.zeros(2, device=self.weight.device))

    def enable_sparse_pruning(self, spec: Pruning) -> None:
        self.sparse_pruning = spec
        if spec.method == "snip_momentum":
            self._enable_snip_momentum()
            return
        self._add_mask(_SPARSE, spec, self.weight.detach().abs(), self.weight.shape)

    def enable_row_pruning(self, spec: Pruning) -> None:
        self.row_pruning = spec
        self._add_mask(_ROW, spec, self.weight.detach().abs().sum(dim=1, keepdim=True), (self.out_features, 1))

    def enable_head_pruning(self, spec: Pruning) -> None:
        if spec.method != "topk":
            raise ValueError(f"head pruning supports method 'topk' only (as DeepSpeed), got {spec.method!r}")
        if self.in_features % spec.num_heads:
            raise ValueError(f"num_heads={spec.num_heads} does not divide in_features={self.in_features}")
        self.head_pruning = spec
        scores = torch.empty(1, spec.num_heads, device=self.weight.device, dtype=self.weight.dtype)
        nn.init.kaiming_uniform_(scores, a=5**0.5)
        self.head_pruning_scores = nn.Parameter(scores)

    def _on(self, spec) -> bool:
        return spec is not None and self.step >= spec.offset

    def sparse_mask(self) -> torch.Tensor:
        return self._mask(self.sparse_pruning, _SPARSE)

    def row_mask(self) -> torch.Tensor:
        """Shape (out_features, 1)."""
        return self._mask(self.row_pruning, _ROW)

    def head_mask(self) -> torch.Tensor:
        """Shape (1, num_heads)."""
        return topk_mask(self.head_pruning_scores, self.head_pruning.ratio)

    def compressed_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias the forward multiplies by, techniques applied."""
        weight, bias = self.weight, self.bias
        if self._bits is not None:
            weight = fake_quantize(weight, replace(self.weight_quantization.grid, bits=self._bits))
        if self._on(self.sparse_pruning):
            weight = weight * self.sparse_mask()
        if self._on(self.row_pruning):
            mask = self.row_mask()
            weight = weight * mask
            bias = bias * mask.view(-1) if bias is not None else None
        if self._on(self.head_pruning):
            heads = self.head_pruning.num_heads
            weight = (weight.view(self.out_features, heads, -1) * self.head_mask().view(1, heads, 1)).view_as(weight)
        return weight, bias

    def _quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.activation_quantization
        if spec.static:
            if self.training:
                low, high = x.detach().min(), x.detach().max()
                if self.x_min_max[0] == self.x_min_max[1]:
                    self.x_min_max.copy_(torch.stack([low, high]))
                self.x_min_max.mul_(spec.momentum).add_(torch.stack([low, high]), alpha=1 - spec.momentum)
            grid = QuantSpec(bits=spec.bits, symmetric=spec.symmetric)
            return fake_quantize(x, grid, (self.x_min_max[0], self.x_min_max[1]))
        grid = QuantSpec(bits=spec.bits, groups=x.numel() // x.shape[-1], symmetric=spec.symmetric)
        return fake_quantize(x, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.compressed_weight()
        if self._on(self.activation_quantization):
            x = self._quantize_input(x)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        on = [
            n
            for n in ("weight_quantization", "sparse_pruning", "row_pruning", "head_pruning", "activation_quantization")
            if getattr(self, n) is not None
        ]
        return f"{super().extra_repr()}, compression={'+'.join(on) or 'none'}"
