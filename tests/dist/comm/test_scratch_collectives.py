"""The scratch forms of reduce-scatter and all-gather give what the real collectives give,
on gloo (as all-reduces) and through the real collectives."""

import pytest
import torch

from shardwise.comm import Communicator
from shardwise.testing import run_distributed


def _compare(rank, world_size, by_all_reduce):
    comm = Communicator(name="test", check_hangs=False)
    comm.scratch_by_all_reduce = by_all_reduce
    comm.scratch_gather_min_numel = 0  # the all-reduce form at any size
    generator = torch.Generator().manual_seed(rank)
    # integer values: sums are exact in any order, so the two paths must agree bit for bit
    data = torch.randint(-100, 100, (6 * world_size,), generator=generator).float()
    expected = torch.empty(6)
    comm.reduce_scatter_tensor(expected, data.clone()).wait()
    handle, got = comm.reduce_scatter_scratch(data.clone())
    handle.wait()
    reduced_equal = torch.equal(got, expected)
    # all-gather: this rank's slice in place, the rest garbage
    buffer = torch.full((6 * world_size,), float("nan"))
    buffer[rank * 6 : (rank + 1) * 6] = expected
    comm.all_gather_scratch(buffer).wait()
    full = torch.empty(6 * world_size)
    comm.all_gather_into_tensor(full, expected).wait()
    return reduced_equal, torch.equal(buffer, full), dict(comm.calls)


@pytest.mark.parametrize("world_size", [2, 4])
def test_scratch_collectives_equal_the_real_ones(tmp_path, world_size):
    for by_all_reduce in (True, False):
        for reduced, gathered, calls in run_distributed(
            _compare, world_size=world_size, tmp_path=tmp_path, by_all_reduce=by_all_reduce
        ):
            assert reduced and gathered, by_all_reduce
            # counted under the collective they stand for
            assert calls == {"reduce_scatter": 2, "all_gather": 2}, calls
