"""Sparsity layouts against hand-written 0/1 matrices, per-head behaviour and every error."""

import inspect

import pytest
import torch

from shardwise.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
    check_layout,
)
from shardwise.ops.sparse_attention.sparsity_config import _random_blocks

SEQ_8_BLOCKS = 128  # with the default block of 16


def _matrix(rows: str) -> torch.Tensor:
    return torch.tensor([[int(c) for c in row.split()] for row in rows.strip().splitlines()], dtype=torch.int64)


def _assert_all_heads(layout: torch.Tensor, expected: torch.Tensor, num_heads: int) -> None:
    assert layout.dtype == torch.int64
    assert layout.shape == (num_heads, *expected.shape)
    for h in range(num_heads):
        assert torch.equal(layout[h], expected), f"head {h}:\n{layout[h]}"


# DeepSpeed's constructor arguments and defaults (deepspeed/ops/sparse_attention).
_SIGNATURES = {
    SparsityConfig: dict(num_heads=None, block=16, different_layout_per_head=False),
    DenseSparsityConfig: dict(num_heads=None, block=16, different_layout_per_head=False),
    FixedSparsityConfig: dict(
        num_heads=None,
        block=16,
        different_layout_per_head=False,
        num_local_blocks=4,
        num_global_blocks=1,
        attention="bidirectional",
        horizontal_global_attention=False,
        num_different_global_patterns=1,
    ),
    VariableSparsityConfig: dict(
        num_heads=None,
        block=16,
        different_layout_per_head=False,
        num_random_blocks=0,
        local_window_blocks=[4],
        global_block_indices=[0],
        global_block_end_indices=None,
        attention="bidirectional",
        horizontal_global_attention=False,
    ),
    BigBirdSparsityConfig: dict(
        num_heads=None,
        block=16,
        different_layout_per_head=False,
        num_random_blocks=1,
        num_sliding_window_blocks=3,
        num_global_blocks=1,
        attention="bidirectional",
    ),
    BSLongformerSparsityConfig: dict(
        num_heads=None,
        block=16,
        different_layout_per_head=False,
        num_sliding_window_blocks=3,
        global_block_indices=[0],
        global_block_end_indices=None,
        attention="bidirectional",
    ),
    LocalSlidingWindowSparsityConfig: dict(
        num_heads=None, block=16, num_sliding_window_blocks=3, attention="unidirectional"
    ),
}


@pytest.mark.parametrize("cls", list(_SIGNATURES), ids=lambda c: c.__name__)
def test_signature_matches_deepspeed(cls):
    params = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in params] == list(_SIGNATURES[cls])
    for p in params:
        default = None if p.default is inspect.Parameter.empty else p.default
        if isinstance(default, tuple):
            default = list(default)
        assert default == _SIGNATURES[cls][p.name], p.name


def test_base_setup_layout_and_propagation():
    config = SparsityConfig(num_heads=3, block=8)
    layout = config.setup_layout(32)
    assert layout.dtype == torch.int64 and layout.shape == (3, 4, 4)
    assert not layout.any()
    layout[0, 1, 2] = 1
    assert config.check_and_propagate_first_head_layout(layout)[2, 1, 2] == 1
    per_head = SparsityConfig(num_heads=3, block=8, different_layout_per_head=True)
    layout = per_head.setup_layout(32)
    layout[0, 1, 2] = 1
    assert per_head.check_and_propagate_first_head_layout(layout)[1:].sum() == 0
    assert config.num_layout_heads == 1 and per_head.num_layout_heads == 3
    with pytest.raises(NotImplementedError, match="FixedSparsityConfig"):
        config.make_layout(32)


def test_dense():
    _assert_all_heads(DenseSparsityConfig(2, block=4).make_layout(16), torch.ones(4, 4, dtype=torch.int64), 2)


FIXED_BI = _matrix("""
1 1 1 1 0 0 0 1
1 1 1 1 0 0 0 1
1 1 1 1 0 0 0 1
1 1 1 1 0 0 0 1
0 0 0 1 1 1 1 1
0 0 0 1 1 1 1 1
0 0 0 1 1 1 1 1
0 0 0 1 1 1 1 1
""")

FIXED_BI_HORIZONTAL = _matrix("""
1 1 1 1 0 0 0 1
1 1 1 1 0 0 0 1
1 1 1 1 0 0 0 1
1 1 1 1 1 1 1 1
0 0 0 1 1 1 1 1
0 0 0 1 1 1 1 1
0 0 0 1 1 1 1 1
1 1 1 1 1 1 1 1
""")

FIXED_UNI = _matrix("""
1 0 0 0 0 0 0 0
1 1 0 0 0 0 0 0
1 1 1 0 0 0 0 0
1 1 1 1 0 0 0 0
0 0 0 1 1 0 0 0
0 0 0 1 1 1 0 0
0 0 0 1 1 1 1 0
0 0 0 1 1 1 1 1
""")

# Windows {0,1,2} {3,4,5} {6,7}; global = last block of each window, the short last window
# keeps its global block at its end (block 7).
FIXED_SHORT_LAST_WINDOW = _matrix("""
1 1 1 0 0 1 0 1
1 1 1 0 0 1 0 1
1 1 1 0 0 1 0 1
0 0 1 1 1 1 0 1
0 0 1 1 1 1 0 1
0 0 1 1 1 1 0 1
0 0 1 0 0 1 1 1
0 0 1 0 0 1 1 1
""")

# Global groups of 2 blocks (2,3 and 6,7), unidirectional: block-level causal throughout.
FIXED_UNI_TWO_GLOBAL = _matrix("""
1 0 0 0 0 0 0 0
1 1 0 0 0 0 0 0
1 1 1 0 0 0 0 0
1 1 1 1 0 0 0 0
0 0 1 1 1 0 0 0
0 0 1 1 1 1 0 0
0 0 1 1 1 1 1 0
0 0 1 1 1 1 1 1
""")

# Head 1 of two global patterns: the second-to-last block of each window is global.
FIXED_SECOND_PATTERN = _matrix("""
1 1 1 1 0 0 1 0
1 1 1 1 0 0 1 0
1 1 1 1 0 0 1 0
1 1 1 1 0 0 1 0
0 0 1 0 1 1 1 1
0 0 1 0 1 1 1 1
0 0 1 0 1 1 1 1
0 0 1 0 1 1 1 1
""")


def test_fixed_layouts():
    _assert_all_heads(
        FixedSparsityConfig(2, horizontal_global_attention=True).make_layout(SEQ_8_BLOCKS), FIXED_BI_HORIZONTAL, 2
    )
    _assert_all_heads(FixedSparsityConfig(2, attention="unidirectional").make_layout(SEQ_8_BLOCKS), FIXED_UNI, 2)
    _assert_all_heads(FixedSparsityConfig(1, num_local_blocks=3).make_layout(SEQ_8_BLOCKS), FIXED_SHORT_LAST_WINDOW, 1)
    _assert_all_heads(
        FixedSparsityConfig(1, num_global_blocks=2, attention="unidirectional").make_layout(SEQ_8_BLOCKS),
        FIXED_UNI_TWO_GLOBAL,
        1,
    )


def test_fixed_global_patterns_per_head():
    config = FixedSparsityConfig(3, block=4, different_layout_per_head=True, num_different_global_patterns=2)
    layout = config.make_layout(32)
    assert torch.equal(layout[0], FIXED_BI)
    assert torch.equal(layout[1], FIXED_SECOND_PATTERN)
    assert torch.equal(layout[2], layout[0])  # patterns cycle over heads
    # Per-head layouts with a single pattern: every head the same.
    same = FixedSparsityConfig(3, different_layout_per_head=True).make_layout(SEQ_8_BLOCKS)
    _assert_all_heads(same, FIXED_BI, 3)


# Windows [1, 2, 3] -> {0} {1,2} {3,4,5} {6,7}; global ranges [0,1) and [5,7).
VARIABLE_BI = _matrix("""
1 0 0 0 0 1 1 0
1 1 1 0 0 1 1 0
1 1 1 0 0 1 1 0
1 0 0 1 1 1 1 0
1 0 0 1 1 1 1 0
1 0 0 1 1 1 1 0
1 0 0 0 0 1 1 1
1 0 0 0 0 1 1 1
""")

# Windows [2, 3] -> {0,1} {2,3,4} {5,6,7}; global blocks 1 and 4; causal.
VARIABLE_UNI = _matrix("""
1 0 0 0 0 0 0 0
1 1 0 0 0 0 0 0
0 1 1 0 0 0 0 0
0 1 1 1 0 0 0 0
0 1 1 1 1 0 0 0
0 1 0 0 1 1 0 0
0 1 0 0 1 1 1 0
0 1 0 0 1 1 1 1
""")


def test_variable_layouts():
    kwargs = dict(local_window_blocks=[1, 2, 3], global_block_indices=[0, 5], global_block_end_indices=[1, 7])
    _assert_all_heads(VariableSparsityConfig(2, **kwargs).make_layout(SEQ_8_BLOCKS), VARIABLE_BI, 2)
    horizontal = VARIABLE_BI.clone()
    horizontal[[0, 5, 6]] = 1
    _assert_all_heads(
        VariableSparsityConfig(2, horizontal_global_attention=True, **kwargs).make_layout(SEQ_8_BLOCKS), horizontal, 2
    )
    # Index 20 lies past this sequence's 8 blocks and is skipped.
    uni = VariableSparsityConfig(
        1, local_window_blocks=[2, 3], global_block_indices=[1, 4, 20], attention="unidirectional"
    )
    _assert_all_heads(uni.make_layout(SEQ_8_BLOCKS), VARIABLE_UNI, 1)


def test_variable_random_blocks_are_causal_and_added_to_the_pattern():
    config = VariableSparsityConfig(
        2,
        block=4,
        num_random_blocks=2,
        local_window_blocks=[1],
        global_block_indices=[],
        attention="unidirectional",
        different_layout_per_head=True,
    )
    layout = config.make_layout(64)
    assert torch.equal(layout, layout.tril())
    assert (layout.diagonal(dim1=1, dim2=2) == 1).all()
    extra = layout.sum(-1) - 1  # random blocks beyond the diagonal window
    assert (extra <= 2).all() and extra.sum() > 0


# Window 3 (one block either side), global block 0.
BSLONGFORMER_DEFAULT = _matrix("""
1 1 1 1 1 1 1 1
1 1 1 0 0 0 0 0
1 1 1 1 0 0 0 0
1 0 1 1 1 0 0 0
1 0 0 1 1 1 0 0
1 0 0 0 1 1 1 0
1 0 0 0 0 1 1 1
1 0 0 0 0 0 1 1
""")

# Window 5, global ranges [1,3) and [6,9) (cut to [6,8)), causal.
BSLONGFORMER_UNI_RANGES = _matrix("""
1 0 0 0 0 0 0 0
1 1 0 0 0 0 0 0
1 1 1 0 0 0 0 0
0 1 1 1 0 0 0 0
0 1 1 1 1 0 0 0
0 1 1 1 1 1 0 0
1 1 1 1 1 1 1 0
1 1 1 1 1 1 1 1
""")


def test_bslongformer_layouts():
    _assert_all_heads(BSLongformerSparsityConfig(2).make_layout(SEQ_8_BLOCKS), BSLONGFORMER_DEFAULT, 2)
    config = BSLongformerSparsityConfig(
        2,
        num_sliding_window_blocks=5,
        global_block_indices=[1, 6],
        global_block_end_indices=[3, 9],
        attention="unidirectional",
    )
    _assert_all_heads(config.make_layout(SEQ_8_BLOCKS), BSLONGFORMER_UNI_RANGES, 2)


LOCAL_UNI_3 = _matrix("""
1 0 0 0 0 0 0 0
1 1 0 0 0 0 0 0
0 1 1 0 0 0 0 0
0 0 1 1 0 0 0 0
0 0 0 1 1 0 0 0
0 0 0 0 1 1 0 0
0 0 0 0 0 1 1 0
0 0 0 0 0 0 1 1
""")

LOCAL_BI_5 = _matrix("""
1 1 1 0 0 0
1 1 1 1 0 0
1 1 1 1 1 0
0 1 1 1 1 1
0 0 1 1 1 1
0 0 0 1 1 1
""")


def test_local_sliding_window_layouts():
    _assert_all_heads(LocalSlidingWindowSparsityConfig(3).make_layout(SEQ_8_BLOCKS), LOCAL_UNI_3, 3)
    config = LocalSlidingWindowSparsityConfig(2, block=8, num_sliding_window_blocks=5, attention="bidirectional")
    _assert_all_heads(config.make_layout(48), LOCAL_BI_5, 2)
    with pytest.raises(TypeError):
        LocalSlidingWindowSparsityConfig(2, different_layout_per_head=True)


# Window 3, global blocks 0 and 1, causal.
BIGBIRD_UNI_NO_RANDOM = _matrix("""
1 0 0 0 0 0 0 0
1 1 0 0 0 0 0 0
1 1 1 0 0 0 0 0
1 1 1 1 0 0 0 0
1 1 0 1 1 0 0 0
1 1 0 0 1 1 0 0
1 1 0 0 0 1 1 0
1 1 0 0 0 0 1 1
""")


def test_bigbird_window_and_global():
    _assert_all_heads(BigBirdSparsityConfig(2, num_random_blocks=0).make_layout(SEQ_8_BLOCKS), BSLONGFORMER_DEFAULT, 2)
    config = BigBirdSparsityConfig(2, num_random_blocks=0, num_global_blocks=2, attention="unidirectional")
    _assert_all_heads(config.make_layout(SEQ_8_BLOCKS), BIGBIRD_UNI_NO_RANDOM, 2)


@pytest.mark.parametrize("attention", ["bidirectional", "unidirectional"])
def test_bigbird_random_blocks_on_top_of_window_and_global(attention):
    num_blocks, num_random = 16, 2
    base = BigBirdSparsityConfig(1, block=4, num_random_blocks=0, attention=attention).make_layout(4 * num_blocks)[0]
    layout = BigBirdSparsityConfig(1, block=4, num_random_blocks=num_random, attention=attention).make_layout(
        4 * num_blocks
    )[0]
    assert torch.equal(layout & base, base)
    extra = (layout - base).sum(-1)
    assert (extra <= num_random).all() and extra.sum() > 0
    if attention == "unidirectional":
        assert torch.equal(layout, layout.tril())


@pytest.mark.parametrize("causal", [False, True])
def test_random_block_count_per_row(causal):
    num_blocks, count = 12, 3
    mask = _random_blocks(num_blocks, count, causal, torch.Generator().manual_seed(0))
    expected = [min(count, i + 1) if causal else count for i in range(num_blocks)]
    assert mask.sum(-1).tolist() == expected
    if causal:
        assert torch.equal(mask, mask.tril())
    # Every column is drawn at some point: the draw covers the whole allowed range.
    draws = sum(_random_blocks(num_blocks, count, causal, torch.Generator().manual_seed(s)) for s in range(50))
    assert (draws.tril() if causal else draws).gt(0).sum() == (
        num_blocks * (num_blocks + 1) // 2 if causal else num_blocks * num_blocks
    )


def test_random_layouts_are_reproducible_with_a_seed():
    config = BigBirdSparsityConfig(4, block=4, different_layout_per_head=True, num_random_blocks=3)
    torch.manual_seed(1234)
    first = config.make_layout(128)
    torch.manual_seed(1234)
    assert torch.equal(config.make_layout(128), first)
    torch.manual_seed(4321)
    assert not torch.equal(config.make_layout(128), first)
    from_generator = config.make_layout(128, generator=torch.Generator().manual_seed(7))
    assert torch.equal(config.make_layout(128, generator=torch.Generator().manual_seed(7)), from_generator)


def test_random_layouts_per_head_or_shared():
    per_head = BigBirdSparsityConfig(4, block=4, different_layout_per_head=True, num_random_blocks=3).make_layout(128)
    assert any(not torch.equal(per_head[0], per_head[h]) for h in range(1, 4))
    shared = VariableSparsityConfig(4, block=4, num_random_blocks=3).make_layout(128)
    assert all(torch.equal(shared[0], shared[h]) for h in range(1, 4))


_UNIDIRECTIONAL = [
    FixedSparsityConfig(2, block=4, num_local_blocks=6, num_global_blocks=3, attention="unidirectional"),
    VariableSparsityConfig(
        2,
        block=4,
        num_random_blocks=2,
        local_window_blocks=[3, 5],
        global_block_indices=[2, 9],
        global_block_end_indices=[5, 12],
        attention="unidirectional",
    ),
    BigBirdSparsityConfig(2, block=4, num_random_blocks=3, num_global_blocks=2, attention="unidirectional"),
    BSLongformerSparsityConfig(2, block=4, global_block_indices=[3], attention="unidirectional"),
    LocalSlidingWindowSparsityConfig(2, block=4, num_sliding_window_blocks=5),
]


@pytest.mark.parametrize("config", _UNIDIRECTIONAL, ids=lambda c: type(c).__name__)
def test_unidirectional_layouts_are_causal_and_cover_every_row(config):
    layout = config.make_layout(80)
    assert torch.equal(layout, layout.tril())
    assert (layout.diagonal(dim1=1, dim2=2) == 1).all()
    check_layout(layout)


def test_check_layout():
    layout = torch.ones(2, 3, 3, dtype=torch.int64)
    check_layout(layout)
    layout[1, 2] = 0
    with pytest.raises(ValueError, match="head 1, row 2 is all zero"):
        check_layout(layout)
    with pytest.raises(ValueError, match=r"\[num_heads, num_blocks, num_blocks\]"):
        check_layout(torch.ones(3, 3))


_ATTENTION_CLASSES = [
    FixedSparsityConfig,
    VariableSparsityConfig,
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    LocalSlidingWindowSparsityConfig,
]


@pytest.mark.parametrize("cls", _ATTENTION_CLASSES, ids=lambda c: c.__name__)
def test_unknown_attention_is_refused(cls):
    with pytest.raises(ValueError, match="attention must be 'unidirectional'.*got 'causal'"):
        cls(2, attention="causal")


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: FixedSparsityConfig(0), "num_heads must be an integer >= 1, got 0"),
        (lambda: DenseSparsityConfig(2, block=0), "block must be an integer >= 1"),
        (
            lambda: FixedSparsityConfig(2, num_local_blocks=4, num_global_blocks=3),
            "num_global_blocks=3 must divide num_local_blocks=4",
        ),
        (lambda: FixedSparsityConfig(2, num_global_blocks=0), "num_global_blocks must be"),
        (
            lambda: FixedSparsityConfig(2, num_different_global_patterns=2),
            "num_different_global_patterns=2 needs different_layout_per_head=True",
        ),
        (
            lambda: FixedSparsityConfig(
                2,
                different_layout_per_head=True,
                num_local_blocks=4,
                num_global_blocks=2,
                num_different_global_patterns=3,
            ),
            r"num_different_global_patterns=3 is more than .* = 4 // 2 = 2",
        ),
        (
            lambda: FixedSparsityConfig(2, attention="unidirectional", horizontal_global_attention=True),
            "horizontal_global_attention=True needs attention='bidirectional'",
        ),
        (
            lambda: VariableSparsityConfig(2, attention="unidirectional", horizontal_global_attention=True),
            "horizontal_global_attention=True needs attention='bidirectional'",
        ),
        (lambda: VariableSparsityConfig(2, local_window_blocks=[]), "local_window_blocks needs"),
        (
            lambda: VariableSparsityConfig(2, local_window_blocks=[2, 0]),
            r"local_window_blocks\[\] must be an integer >= 1, got 0",
        ),
        (lambda: VariableSparsityConfig(2, num_random_blocks=-1), "num_random_blocks must be"),
        (
            lambda: VariableSparsityConfig(2, global_block_indices=[-1]),
            r"global_block_indices\[\] must be an integer >= 0, got -1",
        ),
        (
            lambda: VariableSparsityConfig(2, global_block_indices=[0, 4], global_block_end_indices=[2]),
            "global_block_end_indices has 1 entries but global_block_indices has 2",
        ),
        (
            lambda: BSLongformerSparsityConfig(2, global_block_indices=[3], global_block_end_indices=[3]),
            r"end of the range starting at 3\) must be an integer >= 4, got 3",
        ),
        (
            lambda: BSLongformerSparsityConfig(2, num_sliding_window_blocks=0),
            "num_sliding_window_blocks must be an integer >= 1",
        ),
        (
            lambda: BigBirdSparsityConfig(2, num_sliding_window_blocks=0),
            "num_sliding_window_blocks must be an integer >= 1",
        ),
        (
            lambda: LocalSlidingWindowSparsityConfig(2, num_sliding_window_blocks=0),
            "num_sliding_window_blocks must be an integer >= 1",
        ),
    ],
)
def test_constructor_errors(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    "config, seq_len, match",
    [
        (FixedSparsityConfig(2), 100, r"seq_len=100 is not a multiple of block=16.*pad_to_block_size"),
        (DenseSparsityConfig(2), 0, "seq_len must be an integer >= 1"),
        (VariableSparsityConfig(2, num_random_blocks=5), 64, r"num_random_blocks=5 is more than the 4"),
        (BigBirdSparsityConfig(2, num_random_blocks=5), 64, r"num_random_blocks=5 is more than the 4"),
        (BigBirdSparsityConfig(2, num_sliding_window_blocks=5), 64, "num_sliding_window_blocks=5 is more than the 4"),
        (BigBirdSparsityConfig(2, num_global_blocks=5), 64, "num_global_blocks=5 is more than the 4"),
        (
            BSLongformerSparsityConfig(2, num_sliding_window_blocks=5),
            64,
            "num_sliding_window_blocks=5 is more than the 4",
        ),
        (
            LocalSlidingWindowSparsityConfig(2, num_sliding_window_blocks=5),
            64,
            "num_sliding_window_blocks=5 is more than the 4",
        ),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, SparsityConfig) else None,
)
def test_make_layout_errors(config, seq_len, match):
    with pytest.raises(ValueError, match=match):
        config.make_layout(seq_len)
