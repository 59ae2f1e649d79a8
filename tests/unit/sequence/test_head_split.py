"""Which heads each sequence-parallel rank attends with, and the shapes that are refused."""

import pytest

from shardwise.sequence._exchange import HeadSplit


def _ranges(split):
    return [(r.start, r.stop) for r in split.q], [(r.start, r.stop) for r in split.kv]


def test_even_uneven_and_grouped_splits():
    assert _ranges(HeadSplit.build(4, 4, 2)) == ([(0, 2), (2, 4)], [(0, 2), (2, 4)])
    assert _ranges(HeadSplit.build(5, 5, 2)) == ([(0, 3), (3, 5)], [(0, 3), (3, 5)])
    assert _ranges(HeadSplit.build(12, 3, 2)) == ([(0, 8), (8, 12)], [(0, 2), (2, 3)])  # whole query groups
    # fewer key/value heads than ranks: each is replicated on the ranks that share its queries
    assert _ranges(HeadSplit.build(8, 2, 4)) == ([(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 1), (0, 1), (1, 2), (1, 2)])
    assert _ranges(HeadSplit.build(3, 1, 2)) == ([(0, 2), (2, 3)], [(0, 1), (0, 1)])


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "ranks", "message"),
    [
        (3, 3, 4, "use sequence_parallel_size <= 3"),
        (6, 2, 3, "must be a multiple of them"),
        (6, 4, 2, "multiple of the key/value heads"),
        (2, 1, 4, "use sequence_parallel_size <= 2"),
    ],
)
def test_shapes_that_cannot_be_split_are_refused(q_heads, kv_heads, ranks, message):
    with pytest.raises(ValueError, match=message):
        HeadSplit.build(q_heads, kv_heads, ranks)
