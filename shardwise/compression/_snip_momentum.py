"""Sparse pruning's ``snip_momentum`` method: the pruner of Intel Neural Compressor that
DeepSpeed's ``init_compression`` set up, rebuilt on :class:`CompressedLinear`.

[Note: snip_momentum schedule]
Each pruned weight has a score, ``score = 0.9 * score + |weight * grad|``, updated at every
optimizer step with the step's gradients (summed over its micro-batches by a hook on the
weight, before data-parallel reduction or ZeRO-2's bucketing, so it works at stages 0-2).
Pruning steps are ``schedule_offset``, ``schedule_offset + stride``, ... up to
``schedule_offset_end``: ``P = (end - offset) // stride + 1`` of them. At the forward of
the ``k``-th (1-based) the mask is recomputed from the scores summed over ``NxM`` blocks
(``block_pattern``), over all pruned layers together (INC's global scope): the blocks with
the lowest scores are zeroed so that the kept fraction is ``dense_ratio ** (k / P)`` (INC's
default exponential decay), which is ``dense_ratio`` at the last one. A pruned block stays
pruned (its masked weights get no gradient, and it sorts below every live block). Masks
and scores are buffers (``sparse_pruning_mask``, ``sparse_snip_scores``), saved with the
model; the step is the engine's. With several data-parallel ranks each rank scores its own
gradients and the block scores are summed over the default process group before
choosing, so every rank keeps the same blocks. Unlike INC, no per-layer cap (its
``max_sparsity_ratio_per_op``, 0.98) is applied.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config._compression import parse_block_pattern

MOMENTUM = 0.9
"""INC's snip_momentum decay of the previous score."""


@dataclass(frozen=True, kw_only=True)
class SnipSchedule:
    """The snip_momentum settings of ``shared_parameters`` (see [Note: snip_momentum schedule])."""

    dense_ratio: float
    block: tuple[int, int]
    offset: int
    offset_end: int
    stride: int

    @classmethod
    def from_shared(cls, shared: Mapping) -> SnipSchedule:
        path = "compression_training.sparse_pruning.shared_parameters.block_pattern"
        return cls(
            dense_ratio=shared["dense_ratio"],
            block=parse_block_pattern(path, shared["block_pattern"]),
            offset=shared["schedule_offset"],
            offset_end=shared["schedule_offset_end"],
            stride=shared["schedule_offset_stride"],
        )

    @property
    def num_prunes(self) -> int:
        return (self.offset_end - self.offset) // self.stride + 1

    def prune_count(self, step: int) -> int | None:
        """``k`` when the forward of ``step`` is the ``k``-th pruning step, else None."""
        since = step - self.offset
        if since < 0 or since % self.stride or since // self.stride >= self.num_prunes:
            return None
        return since // self.stride + 1

    def dense_at(self, count: int) -> float:
        return self.dense_ratio ** (count / self.num_prunes)


def snip_layer_names(model: nn.Module, excluded: list[str]) -> list[str]:
    """Every ``nn.Linear`` of ``model`` that no ``excluded_modules`` pattern finds.

    Raises:
        ValueError: an ``nn.Conv2d`` not excluded (DeepSpeed pruned them too), or no layer left.
    """
    where = "compression_training.sparse_pruning.shared_parameters.excluded_modules"
    patterns = [re.compile(p) for p in excluded]
    names = []
    for name, module in model.named_modules():
        if any(p.search(name) for p in patterns):
            continue
        if isinstance(module, nn.Conv2d):
            raise ValueError(
                f"{where}: snip_momentum of nn.Conv2d layers ({name!r}) is not available in this version of "
                "shardwise; add a pattern matching it to excluded_modules"
            )
        if isinstance(module, nn.Linear):
            names.append(name)
    if not names:
        raise ValueError(f"{where}: snip_momentum found no nn.Linear layer outside excluded_modules {excluded!r}")
    return names


def check_block_fits(layer: nn.Linear, block: tuple[int, int], name: str) -> None:
    rows, cols = block
    if layer.out_features % rows or layer.in_features % cols:
        raise ValueError(
            f"compression_training.sparse_pruning.shared_parameters.block_pattern '{rows}x{cols}' does not tile "
            f"the {layer.out_features}x{layer.in_features} weight of {name!r}; pick a pattern dividing it or "
            "exclude the layer (excluded_modules)"
        )


def _block_sums(scores: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = block
    out, inp = scores.shape
    return scores.view(out // rows, rows, inp // cols, cols).sum(dim=(1, 3))


def _expand(blocks: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    return blocks.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)


class SnipMomentumPruner:
    """Accumulates the scores of the snip_momentum layers and recomputes their masks at the
    pruning steps (see [Note: snip_momentum schedule])."""

    def __init__(self, layers: list[nn.Module], schedule: SnipSchedule):
        self.layers = layers
        self.schedule = schedule

    @torch.no_grad()
    def accumulate(self) -> None:
        """Fold the step's gradients (collected by a hook on each weight) into the scores."""
        for layer in self.layers:
            grad, layer.snip_grad = layer.snip_grad, None
            if grad is not None:
                layer.sparse_snip_scores.mul_(MOMENTUM).add_((layer.weight.detach().float() * grad).abs())

    @torch.no_grad()
    def prune_for(self, step: int) -> None:
        """Recompute the masks if the forward of ``step`` is a pruning step."""
        count = self.schedule.prune_count(step)
        if count is None:
            return
        block = self.schedule.block
        sums = [_block_sums(layer.sparse_snip_scores, block) for layer in self.layers]
        flat = torch.cat([s.flatten() for s in sums])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        # a pruned block keeps a zero score; -1 sorts it below every live block
        masks = torch.cat([layer.sparse_pruning_mask[:: block[0], :: block[1]].flatten() for layer in self.layers])
        flat = torch.where(masks > 0, flat, torch.full_like(flat, -1.0))
        pruned = math.floor((1 - self.schedule.dense_at(count)) * flat.numel() + 1e-6)
        keep = torch.ones_like(flat)
        keep[flat.argsort(stable=True)[:pruned]] = 0
        start = 0
        for layer, s in zip(self.layers, sums, strict=True):
            part = keep[start : start + s.numel()].view_as(s)
            layer.sparse_pruning_mask.copy_(_expand(part, block))
            start += s.numel()
