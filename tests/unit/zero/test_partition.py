"""The bucket partition rule (see [Note: bucket partition rule]), with no process group."""

import pytest
import torch
from torch import nn

from shardwise.zero._bucket import ShardedBucket
from shardwise.zero._partition import partition


@pytest.mark.parametrize(
    "numel, world_size, expected",
    [
        (10, 4, (12, 3)),  # padded up to a multiple of the world size
        (8, 4, (8, 2)),  # already a multiple: no padding
        (0, 3, (0, 0)),
        (1, 3, (3, 1)),
        (7, 1, (7, 7)),
    ],
)
def test_partition_pads_to_the_smallest_multiple_of_the_world_size(numel, world_size, expected):
    assert partition(numel, world_size) == expected


def test_every_element_has_exactly_one_owner_and_padding_is_below_one_element_per_rank():
    for numel in range(40):
        for world_size in range(1, 9):
            padded, shard = partition(numel, world_size)
            assert padded == shard * world_size
            assert numel <= padded < numel + world_size
            owners = [r for r in range(world_size) for _ in range(r * shard, (r + 1) * shard)]
            assert owners == sorted(owners) and len(owners) == padded  # contiguous, back to back


@pytest.mark.parametrize("numel, world_size", [(-1, 2), (4, 0)])
def test_partition_refuses_negative_sizes_and_empty_worlds(numel, world_size):
    with pytest.raises(ValueError, match=f"cannot partition {numel} elements over {world_size} ranks"):
        partition(numel, world_size)


def test_a_ranks_local_slice_is_its_contiguous_range_of_the_padded_buffer():
    padded, shard = partition(10, 4)
    flat = torch.arange(float(padded))
    bucket = ShardedBucket(0, 0, [nn.Parameter(torch.zeros(10))], [0], 10, padded, shard, flat)
    assert [bucket.local(flat, r).tolist() for r in range(4)] == [
        [0.0, 1.0, 2.0],
        [3.0, 4.0, 5.0],
        [6.0, 7.0, 8.0],
        [9.0, 10.0, 11.0],
    ]
    assert bucket.local(flat, 2).data_ptr() == flat[6:].data_ptr()  # a view, not a copy
