"""The CPU block-sparse kernel: shared key prefixes plus gathered remainders, merged by log-sum-exp.

[Note: prefix and remainder]
Gathering every query block row's key blocks (the plan of [Note: block-sparse gather plan])
copies ``nonzero blocks`` key and value blocks. That is cheap for windows but quadratic for
layouts whose columns many rows share: in the fixed layout every row reads the global block of
every window, so each row gathers ``n / 4`` blocks and the copies reach 19x the key tensor at
4096 tokens. Here the columns of each distinct head layout that at least ``n / 8`` rows attend
to come first, most attended first; the others follow in index order; the keys and values are
copied once in that order (not at all when it is the index order, as in window layouts).
Each row's attended columns then split into

- its *prefix*: the longest run at the start of that order it attends entirely. Consecutive
  rows with the same prefix length attend to one contiguous slice of the ordered keys, a view:
  one flash-attention call per such run (cut into chunks of at most ``_CHUNK_TOKENS`` query
  tokens), with the rows' queries, outputs and gradients as views too, nothing gathered. A run
  that would save fewer than ``_MIN_PREFIX_BLOCKS`` gathered blocks is left to the remainder;
- its *remainder*: everything else, gathered per row as before (rows grouped by width, padded
  slots masked), in chunks of at most ``_CHUNK_TOKENS`` gathered tokens.

The two parts are attention over disjoint key sets, so torch's CPU flash kernel, which also
returns each row's log-sum-exp, gives both, and they merge exactly. The backward is the flash
backward of each part with the merged output and log-sum-exp (the softmax of the whole row,
restricted to the part's keys), gradients added into one buffer per tensor; the gathered keys
are gathered again instead of being kept from the forward. Memory is the ordered copy of the
keys and values, the output and the log-sum-exp, and one chunk.

A row whose masks remove every key has log-sum-exp ``-inf`` in every part: it gets zeros and
zero gradients, as the gather path gives.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

_CHUNK_TOKENS = 1 << 16
"""At most this many key tokens are gathered at once, and at most this many query tokens (over
the heads) go into one prefix call, per batch element and head dimension."""

_SHARED_FRACTION = 8
"""Columns attended by at least ``n / this`` rows lead the column order; the rest keep their
index order, so window layouts need no reordered copy of the keys."""

_MIN_PREFIX_BLOCKS = 4
"""A run of rows with one prefix width takes the prefix path if that saves at least this many
gathered blocks (width x rows); otherwise its rows gather those columns too."""

_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class _Order:
    """Heads that share one layout, and the order of its columns."""

    heads: Tensor
    """``[hg]`` the heads."""
    cols: Tensor | None
    """``[n]`` columns, most attended first; None when that is ``0..n-1``."""
    every_head: bool
    """True when ``heads`` is every head, in order (the keys need no head selection)."""


@dataclass(frozen=True)
class _Prefix:
    """Consecutive query block rows ``start .. stop - 1`` of one head layout, one prefix width."""

    order: int
    """Index into ``_SplitPlan.orders``."""
    start: int
    stop: int
    width: int
    """Key blocks in the prefix."""


@dataclass(frozen=True)
class _Chunk:
    """Remainder rows that share one padded width ``k``."""

    heads: Tensor
    """``[R]`` head of each row."""
    row_blocks: Tensor
    """``[R]`` query block row within its head."""
    cols: Tensor
    """``[R, k]`` key block columns; padding slots hold columns outside the row, masked by ``valid``."""
    valid: Tensor | None
    """``[R, k]`` True for real key blocks; None when nothing is padded."""
    flat: Tensor
    """``[R]`` flat query block index."""
    kv: Tensor
    """``[R * k]`` flat key block index, row-major."""


@dataclass(frozen=True)
class _SplitPlan:
    orders: tuple[_Order, ...]
    prefixes: tuple[_Prefix, ...]
    chunks: tuple[_Chunk, ...]


def build_split_plan(layout: Tensor, block: int, device: torch.device) -> _SplitPlan:
    """The plan of a bool ``[heads, n, n]`` CPU layout whose rows are all nonempty."""
    num_heads, n, _ = layout.shape
    distinct, head_of = torch.unique(layout.reshape(num_heads, n * n), dim=0, return_inverse=True)
    remainder = layout.clone()
    orders, prefixes = [], []
    for index in range(len(distinct)):
        heads = (head_of == index).nonzero().flatten()
        pattern = distinct[index].reshape(n, n)
        counts = pattern.sum(0)
        shared = torch.where(counts >= max(2, n // _SHARED_FRACTION), counts, 0)
        cols = torch.argsort(shared, descending=True, stable=True)
        ordered = pattern[:, cols]
        widths = ordered.to(torch.int32).cumprod(1).sum(1)
        runs = [run for run in _runs(widths) if run[2] * (run[1] - run[0]) >= _MIN_PREFIX_BLOCKS]
        if not runs:
            continue
        identity = bool(cols.equal(torch.arange(n)))
        orders.append(
            _Order(
                heads=heads.to(device),
                cols=None if identity else cols.to(device),
                every_head=bool(heads.equal(torch.arange(num_heads))),
            )
        )
        step = max(1, _CHUNK_TOKENS // (len(heads) * block))
        for start, stop, width in runs:
            remainder[heads[:, None, None], torch.arange(start, stop)[None, :, None], cols[None, None, :width]] = False
            prefixes.extend(
                _Prefix(order=len(orders) - 1, start=first, stop=min(first + step, stop), width=width)
                for first in range(start, stop, step)
            )
    return _SplitPlan(
        orders=tuple(orders), prefixes=tuple(prefixes), chunks=_remainder_chunks(remainder, block, device)
    )


def _runs(widths: Tensor) -> list[tuple[int, int, int]]:
    """``(start, stop, width)`` of each run of consecutive rows with one nonzero prefix width."""
    runs, start = [], 0
    values = widths.tolist()
    for row in range(1, len(values) + 1):
        if row == len(values) or values[row] != values[start]:
            if values[start]:
                runs.append((start, row, values[start]))
            start = row
    return runs


MAX_PADDING_FRACTION = 0.25
"""A row joins a group whose width is ``k`` if it attends to at least ``(1 - this) * k`` blocks."""


def width_groups(flat_layout: Tensor) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """The nonempty rows of a bool ``[rows, n]`` layout, most blocks first, in groups that
    share one padded width ``k``: ``(rows [R], cols [R, k], valid [R, k])`` per group, each
    row's columns ascending, padding slots (columns outside the row) marked invalid."""
    counts = flat_layout.sum(-1)
    order = torch.argsort(counts, descending=True, stable=True)
    order = order[counts[order] > 0]
    sorted_counts = counts[order]
    start = 0
    while start < len(order):
        width = int(sorted_counts[start])
        floor = width - math.floor(width * MAX_PADDING_FRACTION)
        end = start + int((sorted_counts[start:] >= floor).sum())
        rows = order[start:end]
        # A stable descending sort puts each row's nonzero columns first, in ascending order.
        present, cols = torch.sort(flat_layout[rows].to(torch.uint8), dim=1, descending=True, stable=True)
        yield rows, cols[:, :width], present[:, :width].bool()
        start = end


def _remainder_chunks(remainder: Tensor, block: int, device: torch.device) -> tuple[_Chunk, ...]:
    """Rows of the remainder grouped by width, cut into chunks."""
    num_heads, n, block_cols = remainder.shape
    chunks = []
    for rows, cols, valid in width_groups(remainder.reshape(num_heads * n, block_cols)):
        heads = rows // n
        step = max(1, _CHUNK_TOKENS // (cols.shape[1] * block))
        for first in range(0, len(rows), step):
            part = slice(first, first + step)
            chunk_valid = valid[part]
            chunks.append(
                _Chunk(
                    heads=heads[part].to(device),
                    row_blocks=(rows[part] % n).to(device),
                    cols=cols[part].to(device),
                    valid=None if bool(chunk_valid.all()) else chunk_valid.to(device),
                    flat=rows[part].to(device),
                    kv=(heads[part, None] * n + cols[part]).reshape(-1).to(device),
                )
            )
    return tuple(chunks)


def _additive(mask: Tensor, mode: str) -> Tensor:
    """DeepSpeed's mask modes as an additive fp32 mask: "mul" masks zeros, "add" adds as is."""
    if mode == "mul":
        return torch.zeros(mask.shape, device=mask.device).masked_fill(mask == 0, float("-inf"))
    return mask.float()


class _Masks:
    """The additive masks of each part: ``kpm`` is additive ``[b, n, block]``, ``am`` the user's
    ``[n, block, n, block]`` attention mask (converted per ``am_mode`` after gathering)."""

    def __init__(self, kpm: Tensor | None, am: Tensor | None, am_mode: str, block: int, dtype: torch.dtype):
        self.kpm, self.am, self.am_mode, self.block, self.dtype = kpm, am, am_mode, block, dtype

    def prefix(self, order: _Order, prefix: _Prefix) -> Tensor | None:
        """``[b or 1, 1, R * block or 1, width * block]``."""
        cols = order.cols[: prefix.width] if order.cols is not None else None
        bias = None
        if self.kpm is not None:
            kpm = self.kpm[:, : prefix.width] if cols is None else self.kpm[:, cols]
            bias = kpm.reshape(kpm.shape[0], 1, 1, -1)
        if self.am is not None:
            am = self.am[prefix.start : prefix.stop]
            am = am[:, :, : prefix.width] if cols is None else am[:, :, cols]
            am = _additive(am, self.am_mode).reshape(1, 1, (prefix.stop - prefix.start) * self.block, -1)
            bias = am if bias is None else bias + am
        return None if bias is None else bias.to(self.dtype)

    def chunk(self, chunk) -> Tensor | None:
        """``[b or 1, R, block or 1, k * block]`` for rows with ``cols``, ``valid`` and
        ``row_blocks`` (a ``_Chunk``, or a row group of the gather path)."""
        num_rows, k = chunk.cols.shape
        bias = None
        if chunk.valid is not None:
            pad = torch.zeros(chunk.valid.shape, device=chunk.valid.device)
            bias = pad.masked_fill(~chunk.valid, float("-inf"))[None, :, None, :, None]
        if self.kpm is not None:
            part = self.kpm[:, chunk.cols][:, :, None]
            bias = part if bias is None else bias + part
        if self.am is not None:
            part = self.am[chunk.row_blocks[:, None], :, chunk.cols, :].permute(0, 2, 1, 3)[None]
            part = _additive(part, self.am_mode)
            bias = part if bias is None else bias + part
        if bias is None:
            return None
        bias = bias.expand(*bias.shape[:3], k, self.block)
        return bias.reshape(bias.shape[0], num_rows, bias.shape[2], k * self.block).to(self.dtype)


def _attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float | None) -> tuple[Tensor, Tensor]:
    """Flash attention with each row's log-sum-exp, ``-inf`` where the bias removes every key."""
    out, lse = _flash_forward(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    if bias is not None:
        alive = (bias > float("-inf")).any(-1)
        lse = lse.masked_fill(~alive, float("-inf"))
    return out, lse


def _merge(out: Tensor, lse: Tensor, flat: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """Folds a part's ``[b, m, block, d]`` output and ``[b, m, block]`` log-sum-exp into the
    running fp32 ``out`` / ``lse`` at the flat query blocks ``flat``."""
    old_lse, old_out = lse.index_select(1, flat), out.index_select(1, flat)
    new_lse = torch.logaddexp(old_lse, part_lse)
    finite = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
    merged = old_out * (old_lse - finite).exp_()[..., None] + part_out.float() * (part_lse - finite).exp_()[..., None]
    out.index_copy_(1, flat, merged)
    lse.index_copy_(1, flat, new_lse)


def _ordered(t: Tensor, order: _Order) -> Tensor:
    """``[b, hg, n * block, d]``: the heads of ``order`` with their blocks in its column order,
    from ``[b, h, n, block, d]`` blocks; a view when nothing is reordered."""
    if not order.every_head:
        t = t.index_select(1, order.heads)
    if order.cols is not None:
        t = t.index_select(2, order.cols)
    return t.reshape(t.shape[0], t.shape[1], -1, t.shape[-1])


def _rows(t: Tensor, order: _Order, prefix: _Prefix) -> Tensor:
    """The prefix's rows of ``[b, h, n, block, ...]`` as ``[b, hg, R * block, ...]``: a view
    when the layout is every head's."""
    region = t[:, :, prefix.start : prefix.stop]
    if not order.every_head:
        region = region.index_select(1, order.heads)
    return region.flatten(2, 3)


def _put(t: Tensor, order: _Order, prefix: _Prefix, value: Tensor, add: bool) -> None:
    """Writes (or adds) ``[b, hg, R * block, ...]`` into the prefix's rows of ``[b, h, n, block, ...]``."""
    region = t[:, :, prefix.start : prefix.stop]
    value = value.reshape(region.shape[0], -1, *region.shape[2:])
    if order.every_head:
        region.add_(value) if add else region.copy_(value)
    else:
        region.index_add_(1, order.heads, value) if add else region.index_copy_(1, order.heads, value)


class SplitAttention(torch.autograd.Function):
    """Block-sparse attention on CPU by prefixes and remainders. See [Note: prefix and remainder]."""

    @staticmethod
    def forward(
        ctx, query: Tensor, key: Tensor, value: Tensor, plan: _SplitPlan, block: int, scale: float | None, masks: _Masks
    ) -> Tensor:
        batch, num_heads, seq, dim = query.shape
        n = seq // block
        blocks = [t.contiguous().view(batch, num_heads, n, block, dim) for t in (query, key, value)]
        flat_q, flat_k, flat_v = (t.view(batch, num_heads * n, block, dim) for t in blocks)
        out = torch.zeros(batch, num_heads * n, block, dim, dtype=torch.float32)
        lse = torch.full((batch, num_heads * n, block), float("-inf"))
        for order_index, order in enumerate(plan.orders):
            keys, values = _ordered(blocks[1], order), _ordered(blocks[2], order)
            for prefix in (p for p in plan.prefixes if p.order == order_index):
                span = prefix.width * block
                part_out, part_lse = _attend(
                    _rows(blocks[0], order, prefix),
                    keys[:, :, :span],
                    values[:, :, :span],
                    masks.prefix(order, prefix),
                    scale,
                )
                # Prefixes come first and share no row: their results are copied, not merged.
                _put(out.view(blocks[0].shape), order, prefix, part_out, add=False)
                _put(lse.view(blocks[0].shape[:4]), order, prefix, part_lse, add=False)
        for chunk in plan.chunks:
            num_rows = len(chunk.flat)
            q = flat_q.index_select(1, chunk.flat)
            k, v = (t.index_select(1, chunk.kv).view(batch, num_rows, -1, dim) for t in (flat_k, flat_v))
            part_out, part_lse = _attend(q, k, v, masks.chunk(chunk), scale)
            _merge(out, lse, chunk.flat, part_out, part_lse)
        out = out.to(query.dtype)
        ctx.save_for_backward(*blocks, out, lse)
        ctx.plan, ctx.block, ctx.scale, ctx.masks = plan, block, scale, masks
        return out.view(batch, num_heads, seq, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q_blocks, k_blocks, v_blocks, out, lse = ctx.saved_tensors
        batch, num_heads, n, block, dim = q_blocks.shape
        flat = (batch, num_heads * n, block, dim)
        grad = grad.contiguous().view(flat)
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # no key: zero gradients
        grads = tuple(torch.zeros(flat, dtype=torch.float32) for _ in range(3))
        saved = (q_blocks, k_blocks, v_blocks, grad, out, lse)
        for order_index, order in enumerate(ctx.plan.orders):
            prefixes = [p for p in ctx.plan.prefixes if p.order == order_index]
            _prefix_backward(ctx, order, prefixes, saved, grads)
        for chunk in ctx.plan.chunks:
            _chunk_backward(ctx, chunk, saved, grads)
        shape = (batch, num_heads, n * block, dim)
        return (*(g.view(shape).to(q_blocks.dtype) for g in grads), None, None, None, None)


def _prefix_backward(ctx, order: _Order, prefixes: list[_Prefix], saved: tuple, grads: tuple) -> None:
    q_blocks, k_blocks, v_blocks, grad, out, lse = saved
    dq, dk, dv = grads
    batch, num_heads, n, block, dim = q_blocks.shape
    keys, values = _ordered(k_blocks, order), _ordered(v_blocks, order)
    if order.every_head and order.cols is None:  # the keys are a view: add into the gradients
        dkeys, dvalues = (g.view(keys.shape) for g in (dk, dv))
    else:
        dkeys, dvalues = torch.zeros(keys.shape), torch.zeros(values.shape)
    for prefix in prefixes:
        span = prefix.width * block
        q, g, o = (_rows(t.view(q_blocks.shape), order, prefix) for t in (q_blocks, grad, out))
        parts = _flash_backward(
            g,
            q,
            keys[:, :, :span],
            values[:, :, :span],
            o,
            _rows(lse.view(q_blocks.shape[:4]), order, prefix),
            0.0,
            False,
            attn_mask=ctx.masks.prefix(order, prefix),
            scale=ctx.scale,
        )
        _put(dq.view(q_blocks.shape), order, prefix, parts[0], add=True)
        dkeys[:, :, :span] += parts[1]
        dvalues[:, :, :span] += parts[2]
    if not (order.every_head and order.cols is None):
        cols = order.cols if order.cols is not None else torch.arange(n, device=dk.device)
        target = (order.heads[:, None] * n + cols[None, :]).reshape(-1)
        dk.index_add_(1, target, dkeys.view(batch, -1, block, dim))
        dv.index_add_(1, target, dvalues.view(batch, -1, block, dim))


def _chunk_backward(ctx, chunk: _Chunk, saved: tuple, grads: tuple) -> None:
    q_blocks, k_blocks, v_blocks, grad, out, lse = saved
    dq, dk, dv = grads
    batch, _, _, block, dim = q_blocks.shape
    flat_q, flat_k, flat_v = (t.view(grad.shape) for t in (q_blocks, k_blocks, v_blocks))
    num_rows = len(chunk.flat)
    q, g, o = (t.index_select(1, chunk.flat) for t in (flat_q, grad, out))
    k, v = (t.index_select(1, chunk.kv).view(batch, num_rows, -1, dim) for t in (flat_k, flat_v))
    parts = _flash_backward(
        g, q, k, v, o, lse.index_select(1, chunk.flat), 0.0, False, attn_mask=ctx.masks.chunk(chunk), scale=ctx.scale
    )
    dq.index_add_(1, chunk.flat, parts[0].float())
    dk.index_add_(1, chunk.kv, parts[1].reshape(batch, -1, block, dim).float())
    dv.index_add_(1, chunk.kv, parts[2].reshape(batch, -1, block, dim).float())
