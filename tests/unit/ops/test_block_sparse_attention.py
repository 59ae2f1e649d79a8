"""Block-sparse attention equals dense attention masked by the expanded layout (outputs and
q/k/v gradients), never builds a seq x seq tensor, and caches its plan."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.ops.sparse_attention import _block_sparse
from shardwise.ops.sparse_attention._block_sparse import block_sparse_attention
from shardwise.ops.sparse_attention.sparse_self_attention import SparseSelfAttention
from shardwise.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    LocalSlidingWindowSparsityConfig,
)

BATCH, HEADS, DIM, BLOCK = 2, 2, 8, 16


def _window_global(n, window=1, globals_=(0,)):
    idx = torch.arange(n)
    pattern = (idx[:, None] - idx[None, :]).abs() <= window
    pattern[list(globals_), :] = True
    pattern[:, list(globals_)] = True
    return pattern.expand(HEADS, n, n).to(torch.int64)


def _layout(kind, n, seed=0):
    if kind == "random":
        generator = torch.Generator().manual_seed(seed)
        layout = torch.rand(HEADS, n, n, generator=generator) < 0.3
        layout[:, torch.arange(n), torch.arange(n)] = True  # every token sees itself under a causal attn_mask
        return layout.to(torch.int64)
    if kind == "window_global":
        return _window_global(n)
    if kind == "causal":
        return torch.ones(HEADS, n, n, dtype=torch.int64).tril()
    return torch.ones(HEADS, n, n, dtype=torch.int64)


def _reference(q, k, v, layout, block, kpm=None, kpm_mode="add", am=None, am_mode="mul", rpe=None):
    """Dense float64 attention with DeepSpeed's score order: scale, rpe, masks, layout."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if rpe is not None:
        scores = scores + rpe.double()
    for mask, mode, shape in ((kpm, kpm_mode, (q.shape[0], 1, 1, -1)), (am, am_mode, scores.shape[-2:])):
        if mask is not None:
            mask = mask.double().reshape(shape)
            scores = scores + (torch.where(mask == 0, float("-inf"), 0.0) if mode == "mul" else mask)
    allowed = layout.bool().repeat_interleave(block, 1).repeat_interleave(block, 2)
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def _inputs(seq, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, HEADS, seq, DIM, generator=generator).to(dtype).requires_grad_() for _ in range(3)]


def _check(seq, layout, dtype=torch.float32, tol=1e-5, **masks):
    q, k, v = _inputs(seq, dtype)
    out = block_sparse_attention(q, k, v, layout, BLOCK, **masks)
    names = {
        "key_padding_mask": "kpm",
        "key_padding_mask_mode": "kpm_mode",
        "attn_mask": "am",
        "attn_mask_mode": "am_mode",
        "rpe": "rpe",
    }
    ref = _reference(q, k, v, layout, BLOCK, **{names[key]: value for key, value in masks.items()})
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=tol, rtol=tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("kind", ["random", "window_global", "causal", "dense"])
@pytest.mark.parametrize("seq", [64, 256])
def test_matches_dense_attention(kind, seq):
    _check(seq, _layout(kind, seq // BLOCK))


def _kpm(seq, mode):
    generator = torch.Generator().manual_seed(2)
    if mode == "add":
        return torch.randn(BATCH, seq, generator=generator)
    mask = torch.ones(BATCH, seq)
    mask[0, seq - 12 :] = 0  # batch 0 pads its last 12 tokens
    mask[1, 5:9] = 0
    return mask


def _attn_mask(seq, mode):
    if mode == "add":
        return torch.randn(seq, seq, generator=torch.Generator().manual_seed(3))
    return torch.ones(seq, seq).tril()  # token-level causality inside diagonal blocks


@pytest.mark.parametrize("kind", ["random", "window_global", "causal"])
@pytest.mark.parametrize("mode", ["add", "mul"])
def test_masks_match_dense_attention(kind, mode):
    seq = 128
    layout = _layout(kind, seq // BLOCK, seed=1)
    _check(seq, layout, key_padding_mask=_kpm(seq, mode), key_padding_mask_mode=mode)
    _check(seq, layout, attn_mask=_attn_mask(seq, mode), attn_mask_mode=mode)
    _check(
        seq,
        layout,
        key_padding_mask=_kpm(seq, mode),
        key_padding_mask_mode=mode,
        attn_mask=_attn_mask(seq, "mul"),
        attn_mask_mode="mul",
    )


@pytest.mark.parametrize("heads", [1, HEADS])
def test_rpe_matches_dense_attention_and_gets_gradients(heads):
    seq = 64
    layout = _layout("random", seq // BLOCK, seed=4)
    rpe = torch.randn(heads, seq, seq, generator=torch.Generator().manual_seed(5), requires_grad=True)
    _check(seq, layout, rpe=rpe, key_padding_mask=_kpm(seq, "mul"), key_padding_mask_mode="mul")
    q, k, v = _inputs(seq)
    ref_rpe = rpe.detach().clone().requires_grad_()
    block_sparse_attention(q, k, v, layout, BLOCK, rpe=rpe).sum().backward()
    _reference(q, k, v, layout, BLOCK, rpe=ref_rpe).sum().backward()
    torch.testing.assert_close(rpe.grad, ref_rpe.grad.float(), atol=1e-5, rtol=1e-5)


def test_bf16_matches_dense_attention():
    seq = 128
    layout = _layout("window_global", seq // BLOCK)
    _check(seq, layout, dtype=torch.bfloat16, tol=3e-2, key_padding_mask=_kpm(seq, "mul"), key_padding_mask_mode="mul")


def test_single_block_uses_the_whole_sequence():
    _check(BLOCK, torch.ones(HEADS, 1, 1, dtype=torch.int64), attn_mask=_attn_mask(BLOCK, "mul"))


def test_fully_masked_query_gets_zeros():
    layout = _layout("window_global", 4)
    q, k, v = _inputs(64)
    out = block_sparse_attention(
        q, k, v, layout, BLOCK, key_padding_mask=torch.zeros(BATCH, 64), key_padding_mask_mode="mul"
    )
    assert out.eq(0).all()
    assert all(g.isfinite().all() for g in torch.autograd.grad(out.sum(), (q, k, v)))


@pytest.mark.filterwarnings("ignore")
def test_flex_block_mask_and_score_mod_match_the_gather_path():
    # The CUDA path's BlockMask (128-token tiles refined by a mask_mod) and score_mod, run by
    # eager FlexAttention: forward only, as CPU FlexAttention has no backward.
    seq = 256
    layout = _layout("random", seq // BLOCK, seed=6)
    layout[:, :8, :8] = 1  # one full 128-token tile, the rest partial or empty
    q, k, v = (t.detach() for t in _inputs(seq))
    block_mask = _block_sparse._flex_block_mask(layout, BLOCK, seq, q.device)
    assert block_mask.full_kv_num_blocks[0, :, 0].eq(1).all()
    kpm = _kpm(seq, "mul")
    am = torch.randn(seq, seq, generator=torch.Generator().manual_seed(8))
    rpe = torch.randn(1, HEADS, seq, seq, generator=torch.Generator().manual_seed(9))
    for masks in [(None, None, None), (_block_sparse._additive(kpm, "mul"), am, rpe)]:
        kpm_add, attn, pos = masks
        out = _block_sparse._flex_call(
            q, k, v, block_mask, None, kpm_add, attn, None if pos is None else pos.expand(BATCH, -1, -1, -1)
        )
        ref = _reference(
            q,
            k,
            v,
            layout,
            BLOCK,
            kpm=None if kpm_add is None else kpm,
            kpm_mode="mul",
            am=attn,
            am_mode="add",
            rpe=pos,
        )
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_all_zero_row_raises_naming_head_and_row():
    layout = _layout("dense", 4)
    layout[1, 2] = 0
    q, k, v = _inputs(64)
    with pytest.raises(ValueError, match="head 1 row 2"):
        block_sparse_attention(q, k, v, layout, BLOCK)


def test_bad_layout_shape_raises():
    q, k, v = _inputs(64)
    with pytest.raises(ValueError, match="layout must be"):
        block_sparse_attention(q, k, v, _layout("dense", 8), BLOCK)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements any op produces."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_seq_by_seq_tensor_in_forward_or_backward():
    seq, block = 2048, 16
    layout = _window_global(seq // block, globals_=(0, 1))[:1]
    q, k, v = (torch.randn(1, 1, seq, DIM, requires_grad=True) for _ in range(3))
    kpm = torch.ones(1, seq)
    largest = _LargestTensor()
    with largest:
        out = block_sparse_attention(q, k, v, layout, block, key_padding_mask=kpm, key_padding_mask_mode="mul")
        out.sum().backward()
    # The largest pieces are the gathered keys (126 rows x 5 blocks x block x DIM) and the
    # global rows' scores (2 blocks x seq); dense scores would be seq * seq = 4M elements.
    assert largest.numel <= int(layout.sum()) * block * block, largest.numel
    assert largest.numel < seq * seq // 32, largest.numel


def test_plan_is_cached_by_identity_and_content(monkeypatch):
    builds = []
    build = _block_sparse._build_plan
    monkeypatch.setattr(_block_sparse, "_build_plan", lambda *a: builds.append(1) or build(*a))
    monkeypatch.setattr(_block_sparse, "_plans", type(_block_sparse._plans)())
    layout = _layout("random", 4, seed=7)
    q, k, v = _inputs(64)
    first = block_sparse_attention(q, k, v, layout, BLOCK)
    assert block_sparse_attention(q, k, v, layout, BLOCK).equal(first)
    block_sparse_attention(q, k, v, layout.clone(), BLOCK)  # same content, new tensor
    assert len(builds) == 1
    layout[0, 0, 3] = 1 - layout[0, 0, 3]  # in-place edits are seen through the version counter
    layout[0, 0, 0] = 1
    block_sparse_attention(q, k, v, layout, BLOCK)
    assert len(builds) == 2


def test_sparse_self_attention_slices_the_master_layout():
    config = BSLongformerSparsityConfig(num_heads=HEADS, block=BLOCK, num_sliding_window_blocks=3)
    attention = SparseSelfAttention(config, key_padding_mask_mode="mul", max_seq_length=256)
    seq = 128
    layout = attention.get_layout(seq)
    assert layout.equal(config.make_layout(256)[:, : seq // BLOCK, : seq // BLOCK])
    assert attention.get_layout(seq) is layout
    q, k, v = _inputs(seq)
    kpm = _kpm(seq, "mul")
    out = attention(q, k.transpose(-1, -2), v, key_padding_mask=kpm[:, None, None, :])
    ref = _reference(q, k, v, layout, BLOCK, kpm=kpm, kpm_mode="mul")
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert "master_layout" in attention.state_dict()


def test_sparse_self_attention_rejects_bad_inputs():
    config = LocalSlidingWindowSparsityConfig(num_heads=HEADS, block=BLOCK)
    attention = SparseSelfAttention(config, max_seq_length=128)
    with pytest.raises(ValueError, match="pad_to_block_size"):
        attention(*_inputs(72))
    with pytest.raises(ValueError, match="max_seq_length 128"):
        attention(*_inputs(256))
    q = torch.randn(1, 3, 64, DIM)
    with pytest.raises(ValueError, match="3 heads"):
        attention(q, q, q)
    with pytest.raises(ValueError, match="attn_mask_mode"):
        SparseSelfAttention(config, attn_mask_mode="mask")


def _every_config(attention):
    from shardwise.ops.sparse_attention import (
        BigBirdSparsityConfig,
        DenseSparsityConfig,
        FixedSparsityConfig,
        VariableSparsityConfig,
    )

    common = {"num_heads": HEADS, "block": BLOCK}
    directed = {"attention": attention}
    return [
        DenseSparsityConfig(**common),
        FixedSparsityConfig(
            **common,
            num_local_blocks=2,
            num_global_blocks=1,
            different_layout_per_head=True,
            num_different_global_patterns=2,
            **directed,
        ),
        VariableSparsityConfig(
            **common, num_random_blocks=1, local_window_blocks=[1, 2], global_block_indices=[0], **directed
        ),
        BigBirdSparsityConfig(
            **common, num_random_blocks=1, num_sliding_window_blocks=3, num_global_blocks=1, **directed
        ),
        BSLongformerSparsityConfig(**common, num_sliding_window_blocks=3, global_block_indices=[1], **directed),
        LocalSlidingWindowSparsityConfig(**common, num_sliding_window_blocks=3, **directed),
    ]


_CONFIG_NAMES = ["Dense", "Fixed", "Variable", "BigBird", "BSLongformer", "LocalSlidingWindow"]
_CONFIG_CASES = [
    (index, attention)
    for index in range(6)
    for attention in ("bidirectional", "unidirectional")
    if index > 0 or attention == "bidirectional"
]  # Dense has no attention argument


@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "padding"])
@pytest.mark.parametrize("index, attention", _CONFIG_CASES, ids=[f"{_CONFIG_NAMES[i]}-{a}" for i, a in _CONFIG_CASES])
def test_every_config_class_matches_dense_masked_attention(index, attention, padded):
    """SparseSelfAttention over each config class equals dense attention masked by the expanded
    layout (outputs and q/k/v gradients, fp32 to 1e-5), causal and bidirectional, with and
    without a key padding mask; a unidirectional layout gets token-level causality from attn_mask."""
    torch.manual_seed(7)
    config = _every_config(attention)[index]
    seq = 128
    module = SparseSelfAttention(config, key_padding_mask_mode="mul", max_seq_length=seq)
    layout = module.get_layout(seq)
    q, k, v = _inputs(seq)
    masks, reference_masks = {}, {}
    if padded:
        masks["key_padding_mask"] = reference_masks["kpm"] = _kpm(seq, "mul")
        reference_masks["kpm_mode"] = "mul"
    if attention == "unidirectional":
        masks["attn_mask"] = reference_masks["am"] = _attn_mask(seq, "mul")
    out = module(q, k, v, **masks)
    ref = _reference(q, k, v, layout, BLOCK, **reference_masks)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-5, msg=lambda m: f"d{name}: {m}")
    assert 0 < int(layout.sum()) <= layout.numel()


@pytest.mark.parametrize("kind", ["random", "window_global", "causal"])
def test_gather_path_matches_dense_attention(kind):
    """float64 (which torch's CPU flash kernel does not take) runs the gather path that
    relative position scores and devices without that kernel use, masks included."""
    seq = 128
    layout = _layout(kind, seq // BLOCK, seed=1)
    _check(
        seq,
        layout,
        dtype=torch.float64,
        key_padding_mask=_kpm(seq, "mul"),
        key_padding_mask_mode="mul",
        attn_mask=_attn_mask(seq, "mul"),
        attn_mask_mode="mul",
    )
    _check(
        seq,
        layout,
        dtype=torch.float64,
        key_padding_mask=_kpm(seq, "add"),
        attn_mask=_attn_mask(seq, "add"),
        attn_mask_mode="add",
    )


@pytest.mark.parametrize("kind", ["fixed", "longformer", "causal_fixed"])
def test_split_path_prefixes_and_remainders(kind, monkeypatch):
    """The CPU path splits shared columns (a prefix of the column order) from the gathered
    remainder; every combination of the two, a reordered key copy, several head layouts and
    chunked remainders equals dense attention."""
    from shardwise.ops.sparse_attention import FixedSparsityConfig, _split_attention

    monkeypatch.setattr(_split_attention, "_CHUNK_TOKENS", 16 * BLOCK)  # several chunks per group
    seq = 1024
    n = seq // BLOCK
    if kind == "longformer":
        layout = _window_global(n)
    else:
        attention = "unidirectional" if kind == "causal_fixed" else "bidirectional"
        config = FixedSparsityConfig(
            num_heads=HEADS,
            block=BLOCK,
            num_local_blocks=4,
            num_global_blocks=1,
            different_layout_per_head=True,
            num_different_global_patterns=2,
            attention=attention,
        )
        layout = config.make_layout(seq)
    plan = _split_attention.build_split_plan(layout.bool(), BLOCK, torch.device("cpu"))
    assert plan.prefixes and plan.chunks
    assert len(plan.chunks) > len({c.cols.shape[1] for c in plan.chunks})
    if kind == "fixed":
        assert len(plan.orders) == 2 and all(o.cols is not None for o in plan.orders)
    if kind == "longformer":
        assert plan.orders[0].cols is None  # window columns keep their order: no copy
    masks = {"key_padding_mask": _kpm(seq, "mul"), "key_padding_mask_mode": "mul"}
    if kind == "causal_fixed":
        masks.update(attn_mask=_attn_mask(seq, "mul"))
    _check(seq, layout, **masks)


def test_triton_tables_list_each_rows_and_columns_blocks():
    """The Triton kernel's compressed-row tables: each (head, row)'s key blocks in order, and
    the transposed table each (head, column)'s query blocks (its backward for dK/dV)."""
    from shardwise.ops.sparse_attention import _triton_kernel

    layout = BigBirdSparsityConfig(3, 16, different_layout_per_head=True).make_layout(16 * 9)
    (row_offsets, row_blocks), (col_offsets, col_blocks) = _triton_kernel.tables(layout, torch.device("cpu"))
    heads, n, _ = layout.shape
    for h in range(heads):
        for i in range(n):
            start, end = int(row_offsets[h * n + i]), int(row_offsets[h * n + i + 1])
            assert row_blocks[start:end].tolist() == layout[h, i].nonzero().flatten().tolist()
            start, end = int(col_offsets[h * n + i]), int(col_offsets[h * n + i + 1])
            assert col_blocks[start:end].tolist() == layout[h, :, i].nonzero().flatten().tolist()


def test_triton_kernel_only_for_half_precision_power_of_two_shapes():
    from shardwise.ops.sparse_attention import _triton_kernel

    if _triton_kernel.triton is None:
        assert not _triton_kernel.available(torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16), 64)
        return
    assert _triton_kernel.available(torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16), 64)
    assert not _triton_kernel.available(torch.zeros(1, 1, 64, 64), 64)  # fp32 keeps FlexAttention
    assert not _triton_kernel.available(torch.zeros(1, 1, 96, 48, dtype=torch.float16), 48)
    assert not _triton_kernel.available(torch.zeros(1, 1, 64, 8, dtype=torch.float16), 64)
