"""``redundancy_clean``'s per-layer work: fold one technique of a :class:`CompressedLinear`
(or a :class:`CompressedConv2d`'s channel pruning) into its weights, and cut the matching
dimension out of a related layer."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from shardwise.compression._conv import CompressedConv2d
from shardwise.compression._layers import CompressedLinear
from shardwise.compression._quantizers import quantize_values


def _set(layer: nn.Linear, name: str, value: torch.Tensor) -> None:
    old = getattr(layer, name)
    setattr(layer, name, nn.Parameter(value.detach().clone(), requires_grad=old.requires_grad))


def _drop(layer: nn.Module, *names: str) -> None:
    for name in names:
        if hasattr(layer, name):
            delattr(layer, name)


@torch.no_grad()
def clean_layer(layer: CompressedLinear | CompressedConv2d, technique: str, *, shrink: bool) -> torch.Tensor | None:
    """Fold ``technique`` into ``layer`` and switch it off. Row, head and channel pruning
    return the kept rows / heads / output channels (bool) and, with ``shrink``, remove the
    others (the weight's rows, for heads the input columns of each pruned head, for channels
    the filters and biases); without it they are zeroed."""
    if technique == "channel_pruning":
        return _clean_channels(layer, shrink=shrink) if layer.channel_pruning is not None else None
    if technique == "weight_quantization" and layer.weight_quantization is not None:
        spec = layer.weight_quantization
        layer.weight.copy_(quantize_values(layer.weight, dataclasses.replace(spec.grid, bits=spec.target_bits)))
        layer.weight_quantization = None
        layer.set_step(layer.step)
    elif technique == "sparse_pruning" and layer.sparse_pruning is not None:
        layer.weight.mul_(layer.sparse_mask())
        if getattr(layer, "snip_hook", None) is not None:
            layer.snip_hook.remove()
        _drop(layer, "sparse_pruning_mask", "sparse_mask_scores", "sparse_snip_scores", "snip_hook", "snip_grad")
        layer.sparse_pruning = None
    elif technique == "row_pruning" and layer.row_pruning is not None:
        kept = layer.row_mask().detach().view(-1).bool()
        _drop(layer, "row_pruning_mask", "row_mask_scores")
        layer.row_pruning = None
        _cut_rows(layer, kept, shrink=shrink, heads=1)
        return kept
    elif technique == "head_pruning" and layer.head_pruning is not None:
        kept = layer.head_mask().detach().view(-1).bool()
        heads = layer.head_pruning.num_heads
        _drop(layer, "head_pruning_scores")
        layer.head_pruning = None
        columns = kept.repeat_interleave(layer.in_features // heads)
        if shrink:
            _set(layer, "weight", layer.weight[:, columns])
            layer.in_features = int(columns.sum())
        else:
            layer.weight.mul_(columns.to(layer.weight.dtype))
        return kept
    return None


def _cut_rows(layer: nn.Linear, kept: torch.Tensor, *, shrink: bool, heads: int) -> None:
    """Keep the output rows of ``layer`` in ``kept`` (one flag per row, or per block of
    rows when ``heads`` > 1 flags are given for equal blocks)."""
    rows = kept.repeat_interleave(layer.out_features // kept.numel()) if heads > 1 else kept
    if shrink:
        _set(layer, "weight", layer.weight[rows])
        if layer.bias is not None:
            _set(layer, "bias", layer.bias[rows])
        layer.out_features = int(rows.sum())
    else:
        layer.weight.mul_(rows.to(layer.weight.dtype).view(-1, 1))
        if layer.bias is not None:
            layer.bias.mul_(rows.to(layer.bias.dtype))


@torch.no_grad()
def shrink_related(layer: nn.Module, technique: str, kept: torch.Tensor | None) -> None:
    """Remove from a related layer what the pruned layer no longer produces or reads: for
    row pruning the input columns of the removed rows; for head pruning (a Q, K or V
    projection) the output rows of the removed heads.

    Raises:
        ValueError: the related module is not an ``nn.Linear`` or its shape does not fit.
    """
    if kept is None:
        return
    if not isinstance(layer, nn.Linear):
        raise ValueError(f"related module {type(layer).__name__} is not an nn.Linear")
    if technique == "row_pruning":
        if layer.in_features != kept.numel():
            raise ValueError(
                f"a related layer reads {layer.in_features} features, but {kept.numel()} rows were pruned from"
            )
        _set(layer, "weight", layer.weight[:, kept])
        layer.in_features = int(kept.sum())
    elif technique == "head_pruning":
        if layer.out_features % kept.numel():
            raise ValueError(f"a related layer's {layer.out_features} outputs do not split into {kept.numel()} heads")
        _cut_rows(layer, kept, shrink=True, heads=kept.numel())


GROUPED_CONV_PROBLEM = (
    "a grouped Conv2d (groups={}) cannot lose output channels; give its channel_pruning group no "
    "related_modules to zero the pruned channels instead"
)


def _clean_channels(layer: CompressedConv2d, *, shrink: bool) -> torch.Tensor:
    if shrink and layer.groups != 1:
        raise ValueError(GROUPED_CONV_PROBLEM.format(layer.groups))
    kept = layer.channel_mask().detach().view(-1).bool()
    _drop(layer, "channel_pruning_mask", "channel_mask_scores")
    layer.channel_pruning = None
    if shrink:
        _set(layer, "weight", layer.weight[kept])
        if layer.bias is not None:
            _set(layer, "bias", layer.bias[kept])
        layer.out_channels = int(kept.sum())
    else:
        layer.weight.mul_(kept.to(layer.weight.dtype).view(-1, 1, 1, 1))
        if layer.bias is not None:
            layer.bias.mul_(kept.to(layer.bias.dtype))
    return kept


def channel_fit_problem(layer: nn.Module, channels: int) -> str | None:
    """Why ``layer`` cannot follow a convolution with ``channels`` output channels as a
    channel-pruning related module (None: it can)."""
    kind = type(layer).__name__
    if isinstance(layer, nn.BatchNorm2d):
        found = layer.num_features
    elif isinstance(layer, nn.Conv2d):
        if layer.groups != 1:
            return f"it is a grouped Conv2d (groups={layer.groups}), whose input channels cannot be cut"
        found = layer.in_channels
    elif isinstance(layer, nn.Linear):
        if layer.in_features % channels:
            return f"it is an nn.Linear reading {layer.in_features} features, not a multiple of {channels} channels"
        return None
    else:
        return f"it is a {kind}; related modules of channel pruning are nn.BatchNorm2d, nn.Conv2d or nn.Linear"
    if found != channels:
        return f"it is a {kind} of {found} channels, but the pruned convolution has {channels} output channels"
    return None


@torch.no_grad()
def shrink_after_channels(layer: nn.Module, kept: torch.Tensor) -> nn.Module:
    """``layer`` without the channels the pruned convolution no longer produces: a
    BatchNorm2d's features (a plain ``nn.BatchNorm2d`` replaces a masked one), a Conv2d's
    input channels, or an nn.Linear's input features, ``in_features / channels`` of them per
    channel (the convolution's output flattened channel-major, as ``torch.flatten(x, 1)``)."""
    problem = channel_fit_problem(layer, kept.numel())
    if problem is not None:
        raise ValueError(f"a related module cannot lose the pruned channels: {problem}")
    if isinstance(layer, nn.BatchNorm2d):
        norm = nn.BatchNorm2d(
            int(kept.sum()),
            eps=layer.eps,
            momentum=layer.momentum,
            affine=layer.affine,
            track_running_stats=layer.track_running_stats,
            device=kept.device,
        )
        for name in ("weight", "bias"):
            if getattr(layer, name) is not None:
                _set(norm, name, getattr(layer, name)[kept])
        if layer.track_running_stats:
            norm.running_mean = layer.running_mean[kept].clone()
            norm.running_var = layer.running_var[kept].clone()
            norm.num_batches_tracked = layer.num_batches_tracked.clone()
        return norm.train(layer.training)
    if isinstance(layer, nn.Conv2d):
        _set(layer, "weight", layer.weight[:, kept])
        layer.in_channels = int(kept.sum())
        return layer
    columns = kept.repeat_interleave(layer.in_features // kept.numel())
    _set(layer, "weight", layer.weight[:, columns])
    layer.in_features = int(columns.sum())
    return layer
