"""Block-sparse softmax attention driven by a block layout tensor.

``block_sparse_attention`` computes what dense softmax attention computes when every score
outside the layout (expanded from blocks to tokens) is ``-inf``, with DeepSpeed's
``SparseSelfAttention`` masks folded in; it never builds a ``seq x seq`` tensor.

[Note: block-sparse gather plan]
The layout ``[heads, n, n]`` (``n = seq / block``) is turned once into a *plan*: the
``heads * n`` query block rows are sorted by their number of nonzero key blocks and cut into
groups whose rows need at most ``MAX_PADDING_FRACTION`` of padding to share one width ``k``
(``width_groups`` in ``_split_attention.py``, which the split kernel's remainder uses too).
The plan holds the flat index (``head * n + row``) of each group's query blocks and of the
``k`` key blocks each attends to, padded with masked blocks where a row has fewer than ``k``.
A call gathers, with one ``index_select`` per tensor split into groups, each group's query
blocks ``[batch, rows, block, dim]`` and key/value blocks ``[batch, rows, k * block, dim]``
and runs ``scaled_dot_product_attention`` on them; autograd provides the backward (the
gathers become scatter-adds), so forward and backward touch ``O(nonzero blocks)`` memory. Rows that attend to
(nearly) everything, such as global rows, form their own group instead of widening every other
row to ``n`` blocks. Plans are cached by layout content, and by layout identity (guarded by a
weak reference and the tensor's version counter) so repeated calls neither rebuild nor rehash.

Which path runs: on CPU in fp32, bf16 and fp16 without ``rpe``, the split kernel of
[Note: prefix and remainder] (``_split_attention.py``), which gathers only what rows do not share
and has its own backward; on CUDA in fp16 and bf16 without masks, the Triton kernel of
[Note: the Triton block-sparse kernel] (``_triton_kernel.py``) where Triton imports; otherwise on
CUDA the layout becomes a FlexAttention ``BlockMask`` (see ``_flex_attention``); the gather path
above serves everything else (``rpe``, whose gradient the
flash kernels do not give, float64, other devices, and CUDA when FlexAttention cannot compile).
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _triton_kernel
from ._split_attention import SUPPORTED_DTYPES, SplitAttention, _additive, _Masks, build_split_plan, width_groups

logger = logging.getLogger("shardwise")

MaskMode = Literal["add", "mul"]

_CACHE_SIZE = 32
_FLEX_TILE = 128
"""FlexAttention's sparse tile: its kernels need the ``BlockMask`` tile to be a multiple of
their own tile, so layouts with smaller blocks are coarsened to this and refined by a mask_mod."""


@dataclass(frozen=True)
class _RowGroup:
    """Query block rows that share one padded number of key blocks ``k``."""

    num_rows: int
    """``R``, the number of rows."""
    heads: Tensor
    """``[R]`` head of each row."""
    row_blocks: Tensor
    """``[R]`` query block row within its head."""
    cols: Tensor
    """``[R, k]`` key block columns; padding slots hold columns outside the row, masked by ``valid``."""
    valid: Tensor | None
    """``[R, k]`` True for real key blocks; None when the group has no padding."""


@dataclass(frozen=True)
class _Plan:
    groups: tuple[_RowGroup, ...]
    rows: Tensor
    """``[heads * n]`` flat query block index ``head * n + row`` of every group's rows, in group
    order: a permutation."""
    inverse: Tensor
    """``[heads * n]`` the inverse permutation: where each flat query block sits in ``rows``."""
    kv: Tensor
    """Flat key block index ``head * n + col`` of every group's ``[R, k]`` columns, row-major."""


_plans: OrderedDict[tuple, _Plan] = OrderedDict()
_identity: OrderedDict[int, tuple[weakref.ref, int, tuple]] = OrderedDict()


def _remember(cache: OrderedDict, key, value) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)


def _content_key(layout: Tensor, block: int) -> tuple:
    """Key of the layout's content; the identity cache avoids recomputing it per call."""
    entry = _identity.get(id(layout))
    if entry is not None and entry[0]() is layout and entry[1] == layout._version:
        return entry[2]
    dense = layout.detach().to("cpu", torch.bool).contiguous()
    digest = hashlib.blake2b(dense.numpy().tobytes(), digest_size=16).hexdigest()
    key = (tuple(dense.shape), block, digest)
    _remember(_identity, id(layout), (weakref.ref(layout), layout._version, key))
    return key


def _build_plan(layout: Tensor, device: torch.device) -> _Plan:
    """Groups the query block rows of a bool ``[heads, n, n]`` CPU layout. See the note above."""
    num_heads, n, _ = layout.shape
    counts = layout.sum(-1)
    empty = (counts == 0).nonzero()
    if len(empty):
        head, row = (int(x) for x in empty[0])
        raise ValueError(
            f"layout head {head} row {row} has no nonzero block: query block {row} "
            f"of head {head} attends to no key ({len(empty)} such rows in all)"
        )
    groups, kv, ordered = [], [], []
    for rows, cols, valid in width_groups(layout.reshape(num_heads * n, n)):  # every row: none is empty
        heads = rows // n
        ordered.append(rows)
        kv.append((heads[:, None] * n + cols).reshape(-1))
        groups.append(
            _RowGroup(
                num_rows=len(rows),
                heads=heads.to(device),
                row_blocks=(rows % n).to(device),
                cols=cols.to(device),
                valid=None if bool(valid.all()) else valid.to(device),
            )
        )
    order = torch.cat(ordered)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return _Plan(groups=tuple(groups), rows=order.to(device), inverse=inverse.to(device), kv=torch.cat(kv).to(device))


def _plan(layout: Tensor, block: int, device: torch.device, kind: str = "gather"):
    """The cached plan of one kind: "gather" (``_Plan``), "split" (``_SplitPlan``) or
    "triton" (the kernel's compressed-row tables)."""
    key = (_content_key(layout, block), device, kind)
    plan = _plans.get(key)
    if plan is None:
        dense = layout.detach().to("cpu", torch.bool)
        if kind == "gather":
            plan = _build_plan(dense, device)
        elif kind == "split":
            plan = build_split_plan(dense, block, device)
        else:
            plan = _triton_kernel.tables(dense, device)
        _remember(_plans, key, plan)
    return plan


def _group_bias(group: _RowGroup, masks: _Masks, rpe: Tensor | None) -> Tensor | None:
    """The additive mask of one group, ``[batch or 1, R, block or 1, k * block]``: the padding,
    key padding and attention masks as the split path builds them, plus ``rpe``
    (``[b, h, n, block, n, block]``), which only this path takes."""
    bias = masks.chunk(group)
    if rpe is None:
        return bias
    num_rows, k = group.cols.shape
    heads = group.heads if rpe.shape[1] > 1 else torch.zeros_like(group.heads)
    part = rpe[:, heads[:, None], group.row_blocks[:, None], :, group.cols, :]
    part = part.permute(2, 0, 3, 1, 4).reshape(rpe.shape[0], num_rows, masks.block, k * masks.block)
    return part if bias is None else bias + part


def _gather_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    plan: _Plan,
    block: int,
    scale: float | None,
    masks: _Masks,
    rpe: Tensor | None,
) -> Tensor:
    """The path for relative position scores (which need their gradient) and for devices without
    torch's CPU flash kernel. See [Note: block-sparse gather plan]."""
    batch, num_heads, seq, dim = query.shape
    n = seq // block
    rpe = None if rpe is None else rpe.reshape(*rpe.shape[:2], n, block, n, block)
    q_blocks, k_blocks, v_blocks = (t.reshape(batch, num_heads * n, block, dim) for t in (query, key, value))
    # One gather per tensor, split per group: the backward then fills one zero gradient buffer
    # per tensor instead of one per group plus the sums (fresh buffers cost page faults).
    q_groups = _Permute.apply(q_blocks, plan.rows, plan.inverse).split([g.num_rows for g in plan.groups], dim=1)
    kv_sizes = [g.cols.numel() for g in plan.groups]
    k_groups = k_blocks.index_select(1, plan.kv).split(kv_sizes, dim=1)
    v_groups = v_blocks.index_select(1, plan.kv).split(kv_sizes, dim=1)
    outputs = []
    for group, q, k, v in zip(plan.groups, q_groups, k_groups, v_groups):
        bias = _group_bias(group, masks, rpe)
        k, v = (t.view(batch, group.num_rows, -1, dim) for t in (k, v))
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale))
    out = _Permute.apply(torch.cat(outputs, dim=1), plan.inverse, plan.rows)
    return out.view(batch, num_heads, seq, dim)


class _Permute(torch.autograd.Function):
    """``x.index_select(1, index)`` for a permutation ``index``; the backward applies ``inverse``
    instead of scattering into a zero buffer."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(1, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(1, inverse), None, None


def _dense_attention(
    query: Tensor, key: Tensor, value: Tensor, layout: Tensor, block: int, scale: float | None, masks: tuple
) -> Tensor:
    """Masked SDPA over the whole sequence; only for a single block, where it is cheapest."""
    seq = query.shape[2]
    allowed = layout.to(query.device, torch.bool).repeat_interleave(block, 1).repeat_interleave(block, 2)
    bias = torch.zeros(allowed.shape, device=query.device).masked_fill(~allowed, float("-inf"))[None]
    kpm, am, am_mode, rpe = masks
    if kpm is not None:
        bias = bias + kpm.reshape(-1, 1, 1, seq)
    if am is not None:
        bias = bias + _additive(am, am_mode)
    if rpe is not None:
        bias = bias + rpe
    return F.scaled_dot_product_attention(query, key, value, attn_mask=bias.to(query.dtype), scale=scale)


def _validate(query: Tensor, key: Tensor, value: Tensor, layout: Tensor, block: int, modes: tuple[str, str]) -> None:
    if query.dim() != 4 or query.shape != key.shape or key.shape != value.shape:
        raise ValueError(
            "query, key and value must share one [batch, heads, seq, head_dim] shape, got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    _, num_heads, seq, _ = query.shape
    if block <= 0 or seq % block:
        raise ValueError(f"sequence length {seq} must be a multiple of block {block}")
    n = seq // block
    if tuple(layout.shape) != (num_heads, n, n):
        raise ValueError(
            f"layout must be [heads, seq/block, seq/block] = {(num_heads, n, n)}, got {tuple(layout.shape)}"
        )
    for name, mode in zip(("key_padding_mask_mode", "attn_mask_mode"), modes):
        if mode not in ("add", "mul"):
            raise ValueError(f"{name} must be 'add' or 'mul', got {mode!r}")


def block_sparse_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layout: Tensor,
    block: int,
    *,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    key_padding_mask_mode: MaskMode = "add",
    attn_mask: Tensor | None = None,
    attn_mask_mode: MaskMode = "mul",
    rpe: Tensor | None = None,
) -> Tensor:
    """Softmax attention restricted to the nonzero blocks of ``layout``.

    Equals dense attention whose scores ``q . k * scale + rpe + key_padding_mask + attn_mask``
    are ``-inf`` outside the layout expanded to tokens, as DeepSpeed's sparse softmax computes
    them: the layout is the only causality (inside a diagonal block every token sees every
    other one; pass ``attn_mask`` for token-level causality). Forward and backward hold
    ``O(nonzero blocks * block**2)`` memory besides the inputs; no ``seq x seq`` tensor is made.
    The plan derived from the layout is cached (see [Note: block-sparse gather plan]); reuse one
    layout tensor to skip even the content hash. A query row whose masks remove every key
    gets zeros (DeepSpeed's kernel gives NaN there).

    Args:
        query, key, value: ``[batch, heads, seq, head_dim]``; fp32, bf16 or fp16.
        layout: 0/1 ``[heads, seq/block, seq/block]``; query block row i attends key block
            column j where 1. A row of zeros raises ``ValueError`` naming head and row.
        block: tokens per layout block.
        scale: score scale; None means ``head_dim ** -0.5``.
        key_padding_mask: ``[batch, seq]`` (or any shape of that many elements).
        key_padding_mask_mode: "add" adds the mask to the scores; "mul" masks its zeros.
        attn_mask: ``[seq, seq]``, combined per ``attn_mask_mode`` ("add" or "mul", as above).
        rpe: relative position scores ``[heads or 1, seq, seq]`` or ``[batch or 1, heads or 1,
            seq, seq]``, added to the scaled scores; gradients flow into it.
    """
    _validate(query, key, value, layout, block, (key_padding_mask_mode, attn_mask_mode))
    batch, num_heads, seq, _ = query.shape
    kpm = None if key_padding_mask is None else _additive(key_padding_mask.reshape(-1, seq), key_padding_mask_mode)
    am = None if attn_mask is None else attn_mask.reshape(seq, seq)
    if rpe is not None and rpe.dim() == 3:
        rpe = rpe[None]
    plan = _plan(layout, block, query.device)  # validates the rows even where unused
    if seq == block:
        return _dense_attention(query, key, value, layout, block, scale, (kpm, am, attn_mask_mode, rpe))
    plain = kpm is None and am is None and rpe is None
    if query.is_cuda and plain and _triton_kernel.available(query, block):
        tables = _plan(layout, block, query.device, "triton")
        return _triton_kernel.TritonBlockSparse.apply(query, key, value, tables, block, scale)
    if query.is_cuda:
        out = _flex_attention(query, key, value, layout, block, scale, (kpm, am, attn_mask_mode, rpe))
        if out is not None:
            return out
    n = seq // block
    masks = _Masks(
        None if kpm is None else kpm.reshape(-1, n, block),
        None if am is None else am.reshape(n, block, n, block),
        attn_mask_mode,
        block,
        query.dtype,
    )
    if query.device.type == "cpu" and rpe is None and query.dtype in SUPPORTED_DTYPES:
        split = _plan(layout, block, query.device, "split")
        return SplitAttention.apply(query, key, value, split, block, scale, masks)
    return _gather_attention(query, key, value, plan, block, scale, masks, rpe)


_flex_state: dict = {"compiled": None, "failed": False, "timed": set()}
_block_masks: OrderedDict[tuple, object] = OrderedDict()


def _flex_block_mask(layout: Tensor, block: int, seq: int, device: torch.device):
    """A ``BlockMask`` of ``_FLEX_TILE`` tiles: tiles wholly inside the layout are full, tiles
    partly inside are refined token-wise by a mask_mod that looks the layout up."""
    from torch.nn.attention.flex_attention import BlockMask

    key = (_content_key(layout, block), seq, device)
    if key in _block_masks:
        return _block_masks[key]
    num_heads, n, _ = layout.shape
    per_tile = _FLEX_TILE // block
    tiles = layout.detach().to(device, torch.bool).reshape(num_heads, n // per_tile, per_tile, n // per_tile, per_tile)
    full = tiles.all(dim=4).all(dim=2)
    partial = tiles.any(dim=4).any(dim=2) & ~full

    def indices(selected: Tensor) -> tuple[Tensor, Tensor]:
        order = torch.argsort(selected.to(torch.uint8), dim=-1, descending=True, stable=True)
        return selected.sum(-1).to(torch.int32)[None], order.to(torch.int32)[None]

    dense_layout = layout.detach().to(device, torch.bool)

    def mask_mod(b, h, q_idx, kv_idx):
        return dense_layout[h, q_idx // block, kv_idx // block]

    block_mask = BlockMask.from_kv_blocks(
        *indices(partial), *indices(full), BLOCK_SIZE=_FLEX_TILE, mask_mod=mask_mod, seq_lengths=(seq, seq)
    )
    _remember(_block_masks, key, block_mask)
    return block_mask


def _flex_call(query, key, value, block_mask, scale, kpm, am, rpe):
    from torch.nn.attention.flex_attention import flex_attention

    def score_mod(score, b, h, q_idx, kv_idx):
        if kpm is not None:
            score = score + kpm[b, kv_idx]
        if am is not None:
            score = score + am[q_idx, kv_idx]
        if rpe is not None:
            score = score + rpe[b, h, q_idx, kv_idx]
        return score

    plain = kpm is None and am is None and rpe is None
    return flex_attention(query, key, value, score_mod=None if plain else score_mod, block_mask=block_mask, scale=scale)


def _flex_attention(
    query: Tensor, key: Tensor, value: Tensor, layout: Tensor, block: int, scale: float | None, masks: tuple
) -> Tensor | None:
    """FlexAttention on CUDA, compiled once; None (use the gather path) when not applicable.

    A compile failure on the first call warns once and disables this path for the process;
    the compile time of each (shape, dtype) is logged once at INFO."""
    batch, num_heads, seq, _ = query.shape
    if _flex_state["failed"] or seq % _FLEX_TILE or _FLEX_TILE % block:
        return None
    kpm, am, am_mode, rpe = masks
    kpm = None if kpm is None else kpm.expand(batch, seq)
    am = None if am is None else _additive(am, am_mode)
    rpe = None if rpe is None else rpe.expand(batch, num_heads, seq, seq)
    try:
        if _flex_state["compiled"] is None:
            _flex_state["compiled"] = torch.compile(_flex_call)
        block_mask = _flex_block_mask(layout, block, seq, query.device)
        timing_key = (tuple(query.shape), query.dtype, kpm is None, am is None, rpe is None)
        start = time.perf_counter()
        with warnings.catch_warnings():  # torch's own deprecation warnings while compiling are not failures
            warnings.simplefilter("ignore", DeprecationWarning)
            out = _flex_state["compiled"](query, key, value, block_mask, scale, kpm, am, rpe)
    except Exception as error:  # noqa: BLE001 - any compile failure falls back
        _flex_state["failed"] = True
        warnings.warn(
            f"FlexAttention failed ({type(error).__name__}: {error}); block-sparse attention "
            "uses the gather path from now on",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    if timing_key not in _flex_state["timed"]:
        _flex_state["timed"].add(timing_key)
        torch.cuda.synchronize(query.device)
        logger.info(
            "block-sparse FlexAttention compiled for %s %s in %.1f s",
            tuple(query.shape),
            query.dtype,
            time.perf_counter() - start,
        )
    return out
