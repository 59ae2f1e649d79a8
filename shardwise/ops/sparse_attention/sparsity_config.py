"""Block-sparse attention layouts: which key blocks each query block attends to.

[Note: sparsity layout]
A sequence of ``seq_len`` tokens is cut into ``num_blocks = seq_len // block`` blocks. A
layout is an int64 tensor ``[num_heads, num_blocks, num_blocks]`` of zeros and ones:
``layout[h, i, j] == 1`` means that in head ``h`` the queries of block ``i`` attend to the
keys of block ``j``. Each config builds one ``[num_blocks, num_blocks]`` pattern per head as
the union of its parts (local windows, global blocks, random blocks); unless
``different_layout_per_head`` is set, only head 0 is built and copied to every head.
``attention="unidirectional"`` keeps the block-level lower triangle (``j <= i``) only:
masking inside the diagonal blocks is left to the attention mask, as in DeepSpeed.
Random blocks come from torch's RNG (``generator`` or the default one), so seeding torch
reproduces a layout.

The classes, arguments and defaults are DeepSpeed's
(``deepspeed.ops.sparse_attention.sparsity_config``); differences:
- every ``unidirectional`` layout is lower-triangular. DeepSpeed's ``Fixed`` and
  ``Variable`` configs keep blocks above the diagonal when a global group spans several
  blocks, and ``Variable`` draws random blocks from the whole row.
- unidirectional ``BigBird`` draws ``min(num_random_blocks, i + 1)`` random blocks in row
  ``i``; DeepSpeed fails on the first rows when ``num_random_blocks > 1``.
- bad arguments raise ``ValueError`` at construction (DeepSpeed raises
  ``NotImplementedError`` for an unknown ``attention`` and does not check some arguments).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Literal

import torch

Attention = Literal["unidirectional", "bidirectional"]
_ATTENTIONS = ("unidirectional", "bidirectional")


def _check_int(owner: str, name: str, value, minimum: int) -> int:
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")
    return number


def _check_attention(owner: str, attention) -> str:
    if attention not in _ATTENTIONS:
        raise ValueError(
            f"{owner}: attention must be 'unidirectional' (causal, e.g. GPT) or "
            f"'bidirectional' (e.g. BERT), got {attention!r}"
        )
    return attention


def _check_at_most(owner: str, name: str, value: int, num_blocks: int) -> None:
    if value > num_blocks:
        raise ValueError(
            f"{owner}: {name}={value} is more than the {num_blocks} blocks of this "
            f"sequence; use {name} <= {num_blocks} or a longer sequence"
        )


def _global_ranges(owner: str, starts: Sequence[int], ends: Sequence[int] | None) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` block ranges of the global blocks, validated."""
    starts = [_check_int(owner, "global_block_indices[]", s, 0) for s in starts]
    if ends is None:
        return tuple((s, s + 1) for s in starts)
    if len(ends) != len(starts):
        raise ValueError(
            f"{owner}: global_block_end_indices has {len(ends)} entries but "
            f"global_block_indices has {len(starts)}; give one end per start"
        )
    ends = [
        _check_int(owner, f"global_block_end_indices[] (end of the range starting at {s})", e, s + 1)
        for s, e in zip(starts, ends)
    ]
    return tuple(zip(starts, ends))


def _range_mask(num_blocks: int, ranges) -> torch.Tensor:
    """Bool ``[num_blocks]``: blocks in any range; ranges past the sequence are cut off."""
    mask = torch.zeros(num_blocks, dtype=torch.bool)
    for start, end in ranges:
        mask[start:end] = True
    return mask


def _windows(num_blocks: int, sizes: Sequence[int]) -> torch.Tensor:
    """Bool ``[num_blocks, num_blocks]``: block-diagonal windows of ``sizes``, the last
    size repeated until the sequence is covered."""
    mask = torch.zeros(num_blocks, num_blocks, dtype=torch.bool)
    start, i = 0, 0
    while start < num_blocks:
        end = min(start + sizes[min(i, len(sizes) - 1)], num_blocks)
        mask[start:end, start:end] = True
        start, i = end, i + 1
    return mask


def _band(num_blocks: int, half_width: int, causal: bool) -> torch.Tensor:
    """Bool ``[num_blocks, num_blocks]``: ``i - half_width <= j <= i + half_width``
    (``j <= i`` only when ``causal``)."""
    idx = torch.arange(num_blocks)
    offset = idx[:, None] - idx[None, :]
    return (offset <= half_width) & (offset >= (0 if causal else -half_width))


def _random_blocks(num_blocks: int, count: int, causal: bool, generator: torch.Generator | None) -> torch.Tensor:
    """Bool ``[num_blocks, num_blocks]`` with ``count`` distinct random columns per row,
    drawn uniformly from the whole row, or from ``j <= i`` when ``causal`` (then row ``i``
    gets ``min(count, i + 1)``)."""
    mask = torch.zeros(num_blocks, num_blocks, dtype=torch.bool)
    if count == 0:
        return mask
    scores = torch.rand(num_blocks, num_blocks, generator=generator)
    if causal:
        # Future columns sort after every allowed one (rand < 1), then are dropped.
        scores.masked_fill_(torch.ones_like(mask).triu(1), 2.0)
    cols = scores.argsort(dim=1)[:, :count]
    mask.scatter_(1, cols, True)
    return mask.tril() if causal else mask


def check_layout(layout: torch.Tensor) -> None:
    """Raise ``ValueError`` if some query block of some head attends to no key block.

    A row of zeros leaves the softmax of those queries without any key; every row needs at
    least one nonzero block (every config here sets the diagonal).

    Args:
        layout: ``[num_heads, num_blocks, num_blocks]`` 0/1 layout (see
            [Note: sparsity layout]).
    """
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(
            f"sparsity layout must be [num_heads, num_blocks, num_blocks], got shape {tuple(layout.shape)}"
        )
    empty = (layout != 0).sum(dim=-1) == 0
    if bool(empty.any()):
        head, row = empty.nonzero()[0].tolist()
        raise ValueError(
            f"sparsity layout: head {head}, row {row} is all zero, so query block "
            f"{row} attends to no key block ({int(empty.sum())} such rows in all); "
            f"set at least one block in every row, e.g. the diagonal"
        )


class SparsityConfig:
    """Base of the sparsity configs: block size, head count, shared or per-head layouts.

    Subclasses build one head's pattern; :meth:`make_layout` assembles all heads
    (see [Note: sparsity layout]).

    Args:
        num_heads: attention heads of the layer.
        block: block size in tokens; the kernel works on ``block x block`` tiles.
        different_layout_per_head: build each head's layout separately (heads then differ
            where the config has a per-head choice: random blocks, Fixed's global
            patterns); otherwise head 0's layout is copied to every head.
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        owner = type(self).__name__
        self.num_heads = _check_int(owner, "num_heads", num_heads, 1)
        self.block = _check_int(owner, "block", block, 1)
        self.different_layout_per_head = bool(different_layout_per_head)
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """A zero int64 layout ``[num_heads, seq_len // block, seq_len // block]``."""
        owner = type(self).__name__
        _check_int(owner, "seq_len", seq_len, 1)
        if seq_len % self.block != 0:
            raise ValueError(
                f"{owner}: seq_len={seq_len} is not a multiple of block={self.block}; pad the "
                f"inputs with SparseAttentionUtils.pad_to_block_size (and cut the output with "
                f"SparseAttentionUtils.unpad_sequence_output)"
            )
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """Copy head 0's layout to every head unless ``different_layout_per_head``; in place."""
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """The 0/1 int64 layout ``[num_heads, seq_len // block, seq_len // block]``.

        Args:
            seq_len: sequence length in tokens, a multiple of ``block``.
            generator: torch RNG for random blocks; the default generator when None.
        """
        layout = self.setup_layout(seq_len)
        num_blocks = layout.shape[1]
        for h in range(self.num_layout_heads):
            layout[h].copy_(self._head_layout(h, num_blocks, generator))
        return self.check_and_propagate_first_head_layout(layout)

    def _head_layout(self, head: int, num_blocks: int, generator: torch.Generator | None) -> torch.Tensor:
        """Bool ``[num_blocks, num_blocks]`` pattern of ``head``."""
        raise NotImplementedError(
            f"{type(self).__name__} has no layout; use DenseSparsityConfig, FixedSparsityConfig, "
            f"VariableSparsityConfig, BigBirdSparsityConfig, BSLongformerSparsityConfig or "
            f"LocalSlidingWindowSparsityConfig"
        )


class DenseSparsityConfig(SparsityConfig):
    """Every block set: dense attention through the block-sparse path (for comparison).

    Args: as :class:`SparsityConfig`.
    """

    def _head_layout(self, head, num_blocks, generator):
        return torch.ones(num_blocks, num_blocks, dtype=torch.bool)


class FixedSparsityConfig(SparsityConfig):
    """The ``fixed`` pattern of Sparse Transformers (https://arxiv.org/abs/1904.10509).

    Blocks are grouped in consecutive local windows of ``num_local_blocks``; each window
    attends within itself. The last ``num_global_blocks`` of each window (head ``h`` with
    several patterns: the ``h % num_different_global_patterns``-th group from the end) are
    global: every query block attends to them.

    Args:
        num_heads, block, different_layout_per_head: as :class:`SparsityConfig`.
        num_local_blocks: blocks per local window.
        num_global_blocks: consecutive global blocks per window; must divide
            ``num_local_blocks``.
        attention: ``"bidirectional"`` or ``"unidirectional"`` (block-level causal).
        horizontal_global_attention: global blocks also attend to every block
            (bidirectional only).
        num_different_global_patterns: how many heads get distinct global positions, at
            most ``num_local_blocks // num_global_blocks``; > 1 needs
            ``different_layout_per_head``.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_local_blocks: int = 4,
        num_global_blocks: int = 1,
        attention: Attention = "bidirectional",
        horizontal_global_attention: bool = False,
        num_different_global_patterns: int = 1,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        owner = type(self).__name__
        self.num_local_blocks = _check_int(owner, "num_local_blocks", num_local_blocks, 1)
        self.num_global_blocks = _check_int(owner, "num_global_blocks", num_global_blocks, 1)
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(
                f"{owner}: num_global_blocks={num_global_blocks} must divide num_local_blocks={num_local_blocks}"
            )
        self.attention = _check_attention(owner, attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ValueError(
                f"{owner}: horizontal_global_attention=True needs attention='bidirectional', got {attention!r}"
            )
        self.horizontal_global_attention = bool(horizontal_global_attention)
        _check_int(owner, "num_different_global_patterns", num_different_global_patterns, 1)
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(
                f"{owner}: num_different_global_patterns="
                f"{num_different_global_patterns} needs different_layout_per_head="
                f"True (all heads share one layout otherwise)"
            )
        max_patterns = num_local_blocks // num_global_blocks
        if num_different_global_patterns > max_patterns:
            raise ValueError(
                f"{owner}: num_different_global_patterns="
                f"{num_different_global_patterns} is more than num_local_blocks // "
                f"num_global_blocks = {num_local_blocks} // {num_global_blocks} = "
                f"{max_patterns} (the distinct global positions in a window)"
            )
        self.num_different_global_patterns = num_different_global_patterns

    def _head_layout(self, head, num_blocks, generator):
        local_n, global_n = self.num_local_blocks, self.num_global_blocks
        first = local_n - (1 + head % self.num_different_global_patterns) * global_n
        full_end = num_blocks - num_blocks % local_n
        ranges = [(i, i + global_n) for i in range(first, full_end, local_n)]
        if full_end < num_blocks:
            # A short last window keeps its global group inside the sequence.
            start = max(0, min(full_end + first, num_blocks - global_n))
            ranges.append((start, start + global_n))
        is_global = _range_mask(num_blocks, ranges)
        mask = _windows(num_blocks, [local_n]) | is_global[None, :]
        if self.horizontal_global_attention:
            mask |= is_global[:, None]
        return mask.tril() if self.attention == "unidirectional" else mask


class VariableSparsityConfig(SparsityConfig):
    """Fixed's pattern with window sizes, global blocks and random blocks chosen freely.

    Args:
        num_heads, block, different_layout_per_head: as :class:`SparsityConfig`.
        num_random_blocks: random key blocks per query row (from ``j <= i`` when
            unidirectional).
        local_window_blocks: sizes of the consecutive local windows; the last size repeats
            until the sequence is covered.
        global_block_indices: global blocks (every query attends to them); indices past a
            shorter sequence are skipped. With ``global_block_end_indices``: range starts.
        global_block_end_indices: exclusive range ends, one per start; None for single blocks.
        attention: ``"bidirectional"`` or ``"unidirectional"`` (block-level causal).
        horizontal_global_attention: global blocks also attend to every block
            (bidirectional only).
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 0,
        local_window_blocks: Sequence[int] = (4,),
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: Attention = "bidirectional",
        horizontal_global_attention: bool = False,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        owner = type(self).__name__
        self.num_random_blocks = _check_int(owner, "num_random_blocks", num_random_blocks, 0)
        if not local_window_blocks:
            raise ValueError(f"{owner}: local_window_blocks needs at least one window size")
        self.local_window_blocks = [_check_int(owner, "local_window_blocks[]", s, 1) for s in local_window_blocks]
        self._global_ranges = _global_ranges(owner, global_block_indices, global_block_end_indices)
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = _check_attention(owner, attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ValueError(
                f"{owner}: horizontal_global_attention=True needs attention='bidirectional', got {attention!r}"
            )
        self.horizontal_global_attention = bool(horizontal_global_attention)

    def _head_layout(self, head, num_blocks, generator):
        _check_at_most(type(self).__name__, "num_random_blocks", self.num_random_blocks, num_blocks)
        causal = self.attention == "unidirectional"
        is_global = _range_mask(num_blocks, self._global_ranges)
        mask = (
            _random_blocks(num_blocks, self.num_random_blocks, causal, generator)
            | _windows(num_blocks, self.local_window_blocks)
            | is_global[None, :]
        )
        if self.horizontal_global_attention:
            mask |= is_global[:, None]
        return mask.tril() if causal else mask


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (https://arxiv.org/abs/2007.14062): random + sliding window + global blocks.

    Args:
        num_heads, block, different_layout_per_head: as :class:`SparsityConfig`.
        num_random_blocks: random key blocks per query row (row ``i`` gets
            ``min(num_random_blocks, i + 1)`` from ``j <= i`` when unidirectional).
        num_sliding_window_blocks: window width; query block ``i`` attends to
            ``i - w .. i + w`` with ``w = num_sliding_window_blocks // 2``.
        num_global_blocks: the first blocks, attending to and attended by every block.
        attention: ``"bidirectional"`` or ``"unidirectional"`` (block-level causal).
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 1,
        num_sliding_window_blocks: int = 3,
        num_global_blocks: int = 1,
        attention: Attention = "bidirectional",
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        owner = type(self).__name__
        self.num_random_blocks = _check_int(owner, "num_random_blocks", num_random_blocks, 0)
        self.num_sliding_window_blocks = _check_int(owner, "num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.num_global_blocks = _check_int(owner, "num_global_blocks", num_global_blocks, 0)
        self.attention = _check_attention(owner, attention)

    def _head_layout(self, head, num_blocks, generator):
        owner = type(self).__name__
        for name in ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks"):
            _check_at_most(owner, name, getattr(self, name), num_blocks)
        causal = self.attention == "unidirectional"
        is_global = _range_mask(num_blocks, [(0, self.num_global_blocks)])
        mask = (
            _random_blocks(num_blocks, self.num_random_blocks, causal, generator)
            | _band(num_blocks, self.num_sliding_window_blocks // 2, causal=False)
            | is_global[None, :]
            | is_global[:, None]
        )
        return mask.tril() if causal else mask


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (https://arxiv.org/abs/2004.05150): sliding window + global
    blocks that attend to and are attended by every block.

    Args:
        num_heads, block, different_layout_per_head: as :class:`SparsityConfig`.
        num_sliding_window_blocks: window width; query block ``i`` attends to
            ``i - w .. i + w`` with ``w = num_sliding_window_blocks // 2``.
        global_block_indices: global blocks; indices past a shorter sequence are skipped.
            With ``global_block_end_indices``: range starts.
        global_block_end_indices: exclusive range ends, one per start; None for single blocks.
        attention: ``"bidirectional"`` or ``"unidirectional"`` (block-level causal).
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_sliding_window_blocks: int = 3,
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: Attention = "bidirectional",
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        owner = type(self).__name__
        self.num_sliding_window_blocks = _check_int(owner, "num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self._global_ranges = _global_ranges(owner, global_block_indices, global_block_end_indices)
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = _check_attention(owner, attention)

    def _head_layout(self, head, num_blocks, generator):
        _check_at_most(type(self).__name__, "num_sliding_window_blocks", self.num_sliding_window_blocks, num_blocks)
        is_global = _range_mask(num_blocks, self._global_ranges)
        mask = (
            _band(num_blocks, self.num_sliding_window_blocks // 2, causal=False)
            | is_global[None, :]
            | is_global[:, None]
        )
        return mask.tril() if self.attention == "unidirectional" else mask


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """Sliding window only: query block ``i`` attends to ``i - w .. i + w`` (``i - w .. i``
    when unidirectional), ``w = num_sliding_window_blocks // 2``. One layout for all heads.

    Args:
        num_heads, block: as :class:`SparsityConfig`.
        num_sliding_window_blocks: window width in blocks.
        attention: ``"unidirectional"`` (the default here) or ``"bidirectional"``.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        num_sliding_window_blocks: int = 3,
        attention: Attention = "unidirectional",
    ):
        super().__init__(num_heads, block)
        owner = type(self).__name__
        self.num_sliding_window_blocks = _check_int(owner, "num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.attention = _check_attention(owner, attention)

    def _head_layout(self, head, num_blocks, generator):
        _check_at_most(type(self).__name__, "num_sliding_window_blocks", self.num_sliding_window_blocks, num_blocks)
        return _band(num_blocks, self.num_sliding_window_blocks // 2, causal=self.attention == "unidirectional")


__all__ = [
    "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparsityConfig",
    "VariableSparsityConfig",
    "check_layout",
]
