"""``CompressedConv2d``: an ``nn.Conv2d`` whose forward applies weight quantization, sparse
pruning (l1, topk) and channel pruning (DeepSpeed's ``Conv2dLayer_Compress``), and the
BatchNorm that follows a channel-pruned convolution.

[Note: channel pruning and BatchNorm]
A pruned channel's convolution output is zero (its filter and bias are masked), but a
BatchNorm after it still adds its shift (in training mode ``beta``, in eval mode ``beta -
gamma * mean / sqrt(var + eps)``), so the next layer reads a constant there. DeepSpeed's
masked forward kept that constant, then ``redundancy_clean`` removed the channel, so its
cleaned model differed from the trained one. Here a BatchNorm named in the group's
``related_modules`` becomes a :class:`ChannelMaskedBatchNorm2d` at ``init_compression``:
from ``schedule_offset`` on its pruned channels output zero too, and removing them (with the
next layer's input channels) changes nothing the model computes.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from shardwise.compression._layers import _SPARSE, Pruning, WeightQuantization, _CompressedWeight
from shardwise.compression._quantizers import fake_quantize

_CHANNEL = ("channel_pruning_mask", "channel_mask_scores")


class CompressedConv2d(_CompressedWeight, nn.Conv2d):
    """A 2-D convolution whose forward applies, each from its ``schedule_offset`` on (see
    [Note: compression schedule] in ``_layers.py``), weight quantization (groups of the
    flattened filters), sparse pruning (a mask over filter elements; l1, topk or
    snip_momentum) and channel pruning
    (the filters and biases of pruned output channels multiplied by zero), as
    :class:`CompressedLinear` does. Mask and score names are DeepSpeed's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_quantization: WeightQuantization | None = None
        self.sparse_pruning: Pruning | None = None
        self.channel_pruning: Pruning | None = None
        self.step = 0
        self._bits: int | None = None

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> CompressedConv2d:
        """A compressed layer holding ``conv``'s own parameters (not copies).

        Raises:
            ValueError: ``conv`` is a subclass of ``nn.Conv2d`` (its own forward would be lost).
        """
        if isinstance(conv, CompressedConv2d):
            return conv
        if type(conv) is not nn.Conv2d:
            raise ValueError(
                f"{type(conv).__name__} is a subclass of nn.Conv2d with its own behaviour, which a "
                "compressed layer would drop; only plain nn.Conv2d layers are compressed"
            )
        layer = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            groups=conv.groups,
            bias=conv.bias is not None,
            padding_mode=conv.padding_mode,
            device="meta",
        )
        layer.weight = conv.weight
        layer.bias = conv.bias
        layer.train(conv.training)
        return layer

    def enable_channel_pruning(self, spec: Pruning) -> None:
        """``l1``: keep the channels whose filters have the largest L1 norms now (a fixed
        buffer); ``topk``: keep the top-scoring channels of learned scores."""
        self.channel_pruning = spec
        norms = self.weight.detach().abs().sum(dim=(1, 2, 3))
        self._add_mask(_CHANNEL, spec, norms, (self.out_channels, 1, 1, 1))

    def enable_sparse_pruning(self, spec: Pruning) -> None:
        """``l1``: keep the largest filter elements now (a fixed buffer); ``topk``: the top
        entries of learned scores; ``snip_momentum``: a buffer recomputed at its pruning
        steps (see [Note: snip_momentum schedule] in ``_snip_momentum.py``)."""
        self.sparse_pruning = spec
        if spec.method == "snip_momentum":
            self._enable_snip_momentum()
            return
        self._add_mask(_SPARSE, spec, self.weight.detach().abs(), self.weight.shape)

    def sparse_mask(self) -> torch.Tensor:
        return self._mask(self.sparse_pruning, _SPARSE)

    def channel_mask(self) -> torch.Tensor:
        """Shape (out_channels, 1, 1, 1): 1 for a kept channel."""
        return self._mask(self.channel_pruning, _CHANNEL)

    def active_channel_mask(self) -> torch.Tensor | None:
        """The mask the next forward applies (None before ``schedule_offset``)."""
        spec = self.channel_pruning
        if spec is None or self.step < spec.offset:
            return None
        return self.channel_mask()

    def compressed_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The filters and bias the forward convolves with, techniques applied."""
        weight, bias = self.weight, self.bias
        if self._bits is not None:
            weight = fake_quantize(weight, replace(self.weight_quantization.grid, bits=self._bits))
        if self.sparse_pruning is not None and self.step >= self.sparse_pruning.offset:
            weight = weight * self.sparse_mask()
        mask = self.active_channel_mask()
        if mask is not None:
            weight = weight * mask
            bias = bias * mask.view(-1) if bias is not None else None
        return weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.compressed_weight()
        return self._conv_forward(x, weight, bias)

    def extra_repr(self) -> str:
        on = [n for n in ("weight_quantization", "sparse_pruning", "channel_pruning") if getattr(self, n) is not None]
        return f"{super().extra_repr()}, compression={'+'.join(on) or 'none'}"


class ChannelMaskedBatchNorm2d(nn.BatchNorm2d):
    """A BatchNorm2d named in a channel-pruning group's ``related_modules``: its pruned
    channels output zero whenever its convolution's mask is on (see [Note: channel pruning
    and BatchNorm]). The running statistics update as in ``nn.BatchNorm2d``."""

    @classmethod
    def after(cls, norm: nn.BatchNorm2d, conv: CompressedConv2d) -> ChannelMaskedBatchNorm2d:
        """A masked BatchNorm holding ``norm``'s parameters and buffers, following ``conv``."""
        if isinstance(norm, ChannelMaskedBatchNorm2d):
            norm.__dict__["_channel_source"] = conv
            return norm
        layer = cls(
            norm.num_features,
            eps=norm.eps,
            momentum=norm.momentum,
            affine=norm.affine,
            track_running_stats=norm.track_running_stats,
            device="meta",
        )
        layer.weight, layer.bias = norm.weight, norm.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(layer, name, getattr(norm, name))
        layer.train(norm.training)
        # a plain reference, not a submodule: the conv stays where the model has it
        layer.__dict__["_channel_source"] = conv
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        mask = self.__dict__["_channel_source"].active_channel_mask()
        # detached: a topk mask's scores learn from the convolution alone, as in DeepSpeed
        return out if mask is None else out * mask.detach().view(1, -1, 1, 1)
