"""snip_momentum's block patterns (see [Note: snip_momentum schedule] in ``_snip_momentum.py``):
how a pattern cuts a weight's 2-D view into units, scores a unit, and writes the mask of the
units it prunes. Pure functions of tensors, the same on every rank."""

from __future__ import annotations

import torch

from shardwise.config._compression import BlockPattern


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A weight-shaped tensor as Intel Neural Compressor viewed it: an ``[out, in]`` weight as
    it is, a convolution's ``[out, in, kh, kw]`` as ``[out, kh * kw * in]`` (input channels
    fastest)."""
    if tensor.dim() == 2:
        return tensor
    return tensor.permute(0, 2, 3, 1).reshape(tensor.shape[0], -1)


def from_rows(rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The inverse of :func:`as_rows` for a weight of ``shape``."""
    if len(shape) == 2:
        return rows
    out, inp, kh, kw = shape
    return rows.reshape(out, kh, kw, inp).permute(0, 3, 1, 2)


def fit_problem(pattern: BlockPattern, rows_shape: tuple[int, int]) -> str | None:
    """Why ``pattern`` cannot cut a 2-D view of ``rows_shape`` into whole units (None: it can)."""
    out, cols = rows_shape
    if pattern.kind == "NxM" and (out % pattern.n or cols % pattern.m):
        return f"'{pattern}' blocks do not tile its {out}x{cols} weight"
    if pattern.kind == "N:M" and cols % pattern.m:
        return f"'{pattern}' groups of {pattern.m} do not tile the {cols} input weights of its rows"
    return None


def unit_fraction(pattern: BlockPattern, sparsity: float) -> float:
    """The fraction of units to prune for ``sparsity`` of the weights: a block is all pruned,
    an N:M group has N of its M weights pruned."""
    return sparsity if pattern.kind == "NxM" else min(1.0, sparsity * pattern.m / pattern.n)


def unit_scores(pattern: BlockPattern, scores: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(score, unpruned) of each unit of a 2-D view: an NxM block's summed scores; an N:M
    group's N lowest scores summed (the weights it would lose)."""
    out, cols = scores.shape
    if pattern.kind == "NxM":
        rows, width = pattern.n, pattern.m
        sums = scores.view(out // rows, rows, cols // width, width).sum(dim=(1, 3))
        return sums, mask[::rows, ::width] > 0
    groups = scores.view(out, cols // pattern.m, pattern.m)
    lowest = groups.sort(dim=-1, stable=True).values[..., : pattern.n].sum(dim=-1)
    return lowest, (mask.view_as(groups) > 0).all(dim=-1)


def unit_mask(pattern: BlockPattern, keep: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The 2-D mask after pruning every unit ``keep`` is False for: a block is zeroed whole;
    a group newly pruned loses its N lowest-scored weights, one pruned before keeps its mask."""
    if pattern.kind == "NxM":
        return keep.repeat_interleave(pattern.n, dim=0).repeat_interleave(pattern.m, dim=1).to(mask.dtype)
    out, cols = scores.shape
    groups = scores.view(out, cols // pattern.m, pattern.m)
    lowest = groups.argsort(dim=-1, stable=True)[..., : pattern.n]
    thinned = torch.ones_like(groups, dtype=mask.dtype).scatter_(-1, lowest, 0)
    before = mask.view_as(groups)
    newly = ~keep & (before > 0).all(dim=-1)
    return torch.where(newly.unsqueeze(-1), thinned, before).reshape(out, cols)
