"""``redundancy_clean``'s per-layer work: fold one technique of a :class:`CompressedLinear`
into its weights, and cut the matching dimension out of a related layer."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

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
def clean_layer(layer: CompressedLinear, technique: str, *, shrink: bool) -> torch.Tensor | None:
    """Fold ``technique`` into ``layer`` and switch it off. Row and head pruning return the
    kept rows / heads (bool) and, with ``shrink``, remove the others (the weight's rows, or
    for heads the input columns of each pruned head); without it they are zeroed."""
    if technique == "weight_quantization" and layer.weight_quantization is not None:
        spec = layer.weight_quantization
        layer.weight.copy_(quantize_values(layer.weight, dataclasses.replace(spec.grid, bits=spec.target_bits)))
        layer.weight_quantization = None
        layer.set_step(layer.step)
    elif technique == "sparse_pruning" and layer.sparse_pruning is not None:
        layer.weight.mul_(layer.sparse_mask())
        _drop(layer, "sparse_pruning_mask", "sparse_mask_scores")
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
