"""Sparse pruning's ``snip_momentum`` method: the pruner of Intel Neural Compressor that
DeepSpeed's ``init_compression`` set up, rebuilt on :class:`CompressedLinear` and
:class:`CompressedConv2d`.

[Note: snip_momentum schedule]
Each pruned weight has a score, ``score = 0.9 * score + |weight * grad|``, updated at every
optimizer step whose scores a later pruning step reads. ``grad`` is the step's gradient of
the global batch: a hook on the weight sums the rank's micro-batch gradients (before ZeRO's
bucketing, so it works at stages 0-2), and with several ranks one all-reduce over the
default process group (every rank a data-parallel replica) averages them. DeepSpeed's
engine all-reduced the gradients in ``backward`` and INC read ``weight.grad`` in the
optimizer's ``step``, after that reduction (at ZeRO-0, the only stage where ``weight.grad``
was still there), so its scores, and here the masks and weights, are those of one process
on the whole batch whatever the data-parallel size. The cost is one all-reduce of the
pruned weights' gradients per step until the last pruning step (none after it; the scores
then stay as they were). DeepSpeed's engine clipped ``weight.grad`` before its optimizer
step, so INC scored the clipped gradient: here the training feature takes ``|weight *
grad|`` before the step (``collect``, the weights not yet updated) and folds it into the
scores after it (``accumulate``), times the clipping coefficient the engine passes to
``after_optimizer_step`` (``min(1, gradient_clipping / (norm + 1e-6))``, 1 without
clipping), which is ``|weight * clipped grad|``. Driven without the engine,
``CompressionScheduler.advance`` takes that coefficient as an argument (default 1).

Pruning steps are ``schedule_offset``, ``schedule_offset + stride``, ... up to
``schedule_offset_end``: ``P = (end - offset) // stride + 1`` of them. At the forward of
the ``k``-th (1-based) the masks are recomputed from the scores of units over all pruned
layers together (INC's global scope): the units with the lowest scores are pruned so that
the pruned fraction of the weights is ``1 - dense_ratio ** (k / P)`` (INC's default
exponential decay), ``1 - dense_ratio`` at the last one. INC's per-layer cap,
``max_sparsity_ratio_per_op``, applies with its default 0.98 (DeepSpeed's config had no
key for it and passed none to INC): the target is at most 0.98 (a ``dense_ratio`` below
0.02 acts as 0.02), and a layer the global threshold would leave with more than 98% of its
units pruned instead keeps its best ``units - int(0.98 * units)`` units and is held at
that mask from then on; its pruned units still count towards the target, so the units it
kept are pruned elsewhere: the threshold is recomputed over the other layers for what
remains, until no other layer passes the cap (INC's loop with ``keep_exact_sparsity_ratio``,
its default). For ``"N:M"`` the cap is on groups, ``0.98 * M / N`` of them, so it binds
only when N / M is above 0.98. INC's ``min_sparsity_ratio_per_op`` (default 0) and the
adjustment that goes with it are not rebuilt: with 0 it only acts when the layers already
hold more zeros than the final target, which this schedule never reaches. Units live on each weight's 2-D
view, INC's: a linear weight as it is, a convolution's ``[out, in, kh, kw]`` as ``[out, kh
* kw * in]`` (``_prune_patterns.as_rows``). ``block_pattern`` ``"NxM"``: a unit is a block
of N rows by M columns, scored by its summed scores and pruned whole. ``"N:M"`` (INC's rule,
N counts the pruned weights): a unit is a group of M consecutive weights of a row, scored
by its N lowest scores, and pruning it zeroes those N; ``1 - dense_ratio`` must not exceed
N / M. A pruned unit stays pruned (its masked weights get no gradient, and it sorts below
every live unit). Rank 0's choice is broadcast, so the ranks agree even if their scores
differ in the last bit. Masks and scores are buffers (``sparse_pruning_mask``,
``sparse_snip_scores``, in the weight's shape), saved with the model; the step is the
engine's (a layer at its cap is found from its mask, so nothing more is saved). Unlike
INC, a weight the pattern does not tile is refused, not skipped. DeepSpeed 0.18's
own call could not run: it imported INC's classes ``from nc`` (an alias, not a module).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardwise.compression import _prune_patterns as patterns
from shardwise.config._compression import BlockPattern, parse_block_pattern

MOMENTUM = 0.9
"""INC's snip_momentum decay of the previous score."""

MAX_SPARSITY = 0.98
"""INC's ``max_sparsity_ratio_per_op`` default: no layer loses more of its weights, and the
target sparsity is capped to it too (DeepSpeed passed no value, so INC's default held)."""

_WHERE = "compression_training.sparse_pruning.shared_parameters"


@dataclass(frozen=True, kw_only=True)
class SnipSchedule:
    """The snip_momentum settings of ``shared_parameters`` (see [Note: snip_momentum schedule])."""

    dense_ratio: float
    pattern: BlockPattern
    offset: int
    offset_end: int
    stride: int

    @classmethod
    def from_shared(cls, shared: Mapping) -> SnipSchedule:
        return cls(
            dense_ratio=shared["dense_ratio"],
            pattern=parse_block_pattern(f"{_WHERE}.block_pattern", shared["block_pattern"]),
            offset=shared["schedule_offset"],
            offset_end=shared["schedule_offset_end"],
            stride=shared["schedule_offset_stride"],
        )

    @property
    def num_prunes(self) -> int:
        return (self.offset_end - self.offset) // self.stride + 1

    @property
    def last_prune(self) -> int:
        """The last pruning step: the scores of later steps are never read."""
        return self.offset + (self.num_prunes - 1) * self.stride

    def prune_count(self, step: int) -> int | None:
        """``k`` when the forward of ``step`` is the ``k``-th pruning step, else None."""
        since = step - self.offset
        if since < 0 or since % self.stride or since // self.stride >= self.num_prunes:
            return None
        return since // self.stride + 1

    def dense_at(self, count: int) -> float:
        """The kept fraction after the ``count``-th pruning step (INC capped the target
        sparsity at ``MAX_SPARSITY``)."""
        return max(self.dense_ratio, 1 - MAX_SPARSITY) ** (count / self.num_prunes)


def snip_layer_names(model: nn.Module, excluded: list[str]) -> list[str]:
    """Every ``nn.Linear`` and ``nn.Conv2d`` of ``model`` that no ``excluded_modules`` pattern
    finds (INC's "Linear" and "Conv" layer kinds).

    Raises:
        ValueError: another convolution not excluded (INC pruned those too), or no layer left.
    """
    compiled = [re.compile(p) for p in excluded]
    names = []
    for name, module in model.named_modules():
        if any(p.search(name) for p in compiled):
            continue
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            names.append(name)
        elif isinstance(module, nn.modules.conv._ConvNd):
            raise ValueError(
                f"{_WHERE}.excluded_modules: snip_momentum of {type(module).__name__} layers ({name!r}) is not "
                "available in this version of shardwise (nn.Linear and nn.Conv2d are); add a pattern matching it "
                "to excluded_modules"
            )
    if not names:
        raise ValueError(
            f"{_WHERE}.excluded_modules: snip_momentum found no nn.Linear or nn.Conv2d layer outside {excluded!r}"
        )
    return names


def check_block_fits(layer: nn.Module, pattern: BlockPattern, name: str) -> None:
    """Raises ValueError when ``pattern`` does not cut ``layer``'s weight into whole units."""
    shape = patterns.as_rows(layer.weight.detach()).shape
    problem = patterns.fit_problem(pattern, (shape[0], shape[1]))
    if problem is not None:
        view = " (the convolution viewed as out x kh*kw*in)" if layer.weight.dim() == 4 else ""
        raise ValueError(
            f"{_WHERE}.block_pattern: {problem} of {name!r}{view}; pick a pattern dividing it or exclude the "
            "layer (excluded_modules)"
        )


def _world_size() -> int:
    """The ranks of the default process group, each taken as a data-parallel replica."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class SnipMomentumPruner:
    """Accumulates the scores of the snip_momentum layers and recomputes their masks at the
    pruning steps (see [Note: snip_momentum schedule])."""

    def __init__(self, layers: list[nn.Module], schedule: SnipSchedule):
        self.layers = layers
        self.schedule = schedule
        self._pending: list[torch.Tensor] | None = None

    def _global_grads(self) -> list[torch.Tensor]:
        """Each layer's gradient of the step, averaged over the ranks (zero where none came)."""
        grads = []
        for layer in self.layers:
            grad, layer.snip_grad = layer.snip_grad, None
            grads.append(grad if grad is not None else torch.zeros_like(layer.sparse_snip_scores))
        world = _world_size()
        if world == 1:
            return grads
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        flat.div_(world)
        return [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]

    @torch.no_grad()
    def collect(self, next_step: int) -> None:
        """Take the step's gradients (collected by a hook on each weight) and the weights
        they apply to, ``|weight * grad|``, when a pruning step at or after ``next_step``
        will read them; call it before the optimizer step changes the weights."""
        if next_step > self.schedule.last_prune:
            for layer in self.layers:
                layer.snip_grad = None
            self._pending = None
            return
        grads = self._global_grads()
        self._pending = [(layer.weight.detach().float() * g).abs() for layer, g in zip(self.layers, grads, strict=True)]

    @torch.no_grad()
    def accumulate(self, next_step: int, clip_coef: float | None = 1.0) -> None:
        """Fold the step's ``|weight * grad|`` into the scores, the gradient scaled by
        ``clip_coef`` (the factor gradient clipping multiplied it by); collects them first
        when :meth:`collect` was not called for this step. ``clip_coef`` None: the optimizer
        skipped the step (an fp16 overflow), whose gradients are dropped, as INC's hook on
        the optimizer's step never ran for it."""
        if self._pending is None:
            self.collect(next_step)
        pending, self._pending = self._pending, None
        if pending is None or clip_coef is None:
            return
        for layer, contribution in zip(self.layers, pending, strict=True):
            layer.sparse_snip_scores.mul_(MOMENTUM).add_(contribution, alpha=clip_coef)

    @torch.no_grad()
    def prune_for(self, step: int) -> None:
        """Recompute the masks if the forward of ``step`` is a pruning step."""
        count = self.schedule.prune_count(step)
        if count is None:
            return
        pattern = self.schedule.pattern
        scores = [patterns.as_rows(layer.sparse_snip_scores) for layer in self.layers]
        masks = [patterns.as_rows(layer.sparse_pruning_mask) for layer in self.layers]
        units = [patterns.unit_scores(pattern, s, m) for s, m in zip(scores, masks, strict=True)]
        # a pruned unit sorts below every live one (scores are >= 0)
        ranked = [torch.where(alive, u, torch.full_like(u, -1.0)).flatten() for u, alive in units]
        fraction = patterns.unit_fraction(pattern, 1 - self.schedule.dense_at(count))
        keep = torch.cat(_choose_kept(ranked, fraction, patterns.unit_fraction(pattern, MAX_SPARSITY))).float()
        if _world_size() > 1:
            dist.broadcast(keep, src=0)
        start = 0
        for layer, s, m, (u, _) in zip(self.layers, scores, masks, units, strict=True):
            part = keep[start : start + u.numel()].view_as(u) > 0
            mask = patterns.unit_mask(pattern, part, s, m)
            layer.sparse_pruning_mask.copy_(patterns.from_rows(mask, layer.sparse_pruning_mask.shape))
            start += u.numel()


def _lowest(ranked: torch.Tensor, count: int) -> torch.Tensor:
    """True for every unit of ``ranked`` but its ``count`` lowest (ties: the first)."""
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if count > 0:
        keep[ranked.argsort(stable=True)[:count]] = False
    return keep


def _choose_kept(ranked: list[torch.Tensor], fraction: float, cap: float) -> list[torch.Tensor]:
    """Which units of each layer stay (``ranked``: each layer's unit scores, -1 where
    pruned): the lowest ``fraction`` of all units are pruned, but no layer beyond ``cap``
    of its units (INC's global scope, see [Note: snip_momentum schedule])."""
    residual = math.floor(fraction * sum(r.numel() for r in ranked) + 1e-6)
    # a layer at its cap keeps its mask, and its pruned units count towards the target
    capped = [int((r < 0).sum()) >= int(cap * r.numel()) for r in ranked]
    residual -= sum(int((r < 0).sum()) for r, c in zip(ranked, capped, strict=True) if c)
    kept = [r >= 0 for r in ranked]
    while not all(capped):
        open_layers = [i for i, c in enumerate(capped) if not c]
        flat = torch.cat([ranked[i] for i in open_layers])
        keep = _lowest(flat, residual) & (flat >= 0)
        newly = False
        for i, part in zip(open_layers, keep.split([ranked[i].numel() for i in open_layers]), strict=True):
            if int((~part).sum()) / part.numel() > cap:  # over the cap: keep its best units
                count = int(cap * part.numel())
                part = _lowest(ranked[i], count)
                capped[i], newly = True, True
                residual -= count
            kept[i] = part
        if not newly:
            break
    return kept
