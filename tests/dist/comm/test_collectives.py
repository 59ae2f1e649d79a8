import os
import time

import pytest
import torch

from shardwise.comm import CollectiveError, Communicator
from shardwise.testing import DistributedTestError, run_distributed


def _counts_and_values(rank, world_size):
    comm = Communicator(timeout_s=30)
    t = torch.full((10,), float(rank + 1))
    comm.all_reduce(t).wait()
    b = torch.arange(4.0) * (rank + 1)
    comm.broadcast(b, src=world_size - 1).wait()
    out = torch.empty(2 * world_size)
    comm.all_gather_into_tensor(out, torch.full((2,), float(rank))).wait()
    rs = torch.empty(3)
    comm.reduce_scatter_tensor(rs, torch.arange(3.0 * world_size)).wait()
    return t.tolist(), b.tolist(), out.tolist(), rs.tolist(), dict(comm.calls), dict(comm.bytes)


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_compute_and_count(tmp_path, world_size):
    results = run_distributed(_counts_and_values, world_size=world_size, tmp_path=tmp_path)
    total = sum(range(1, world_size + 1))
    for rank, (t, b, out, rs, calls, nbytes) in enumerate(results):
        assert t == [float(total)] * 10
        assert b == [x * world_size for x in [0.0, 1.0, 2.0, 3.0]]
        assert out == [float(r) for r in range(world_size) for _ in range(2)]
        assert rs == [world_size * float(3 * rank + i) for i in range(3)]
        assert calls == {"all_reduce": 1, "broadcast": 1, "all_gather": 1, "reduce_scatter": 1}
        assert nbytes["all_reduce"] == 40


DIVERGED_DEADLINE_S = 2
"""The deadline of the diverged cases, which each waits out once; the warm-up all-reduce
brings the ranks to the diverged collectives together."""


def _diverge(rank, world_size, check_hangs=True):
    comm = Communicator(timeout_s=DIVERGED_DEADLINE_S, name="data-parallel", check_hangs=check_hangs)
    comm.all_reduce(torch.ones(8), tag="warm-up").wait()
    if rank == 1:
        comm.broadcast(torch.ones(5), src=0, tag="bucket 7").wait()
    else:
        comm.all_reduce(torch.ones(16), tag="bucket 3").wait()


def test_diverged_ranks_are_named(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_diverge, world_size=2, tmp_path=tmp_path)
    message = str(info.value)
    assert time.monotonic() - start < 60
    assert "CollectiveError" in message
    assert "rank 0 waited in data-parallel group rank 0: all_reduce #2 (16 x float32) [bucket 3]" in message
    assert "rank 1: data-parallel group rank 1: broadcast #2 (5 x float32) [bucket 7]" in message


def test_without_check_hangs_the_error_names_this_ranks_collective_only(tmp_path):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_diverge, world_size=2, tmp_path=tmp_path, check_hangs=False)
    message = str(info.value)
    assert "rank 0 waited in data-parallel group rank 0: all_reduce #2 (16 x float32) [bucket 3]" in message
    assert "not exchanged: comm.check_hangs is false" in message
    assert "  rank 1: data-parallel group rank 1" not in message


def _one_rank_dies(rank, world_size):
    comm = Communicator(timeout_s=60)
    comm.all_reduce(torch.ones(4)).wait()
    if rank == 1:
        os._exit(7)
    try:
        comm.all_reduce(torch.ones(4), tag="after death").wait()
    except CollectiveError as exc:
        return str(exc)
    return "no error"


def test_dead_rank_fails_fast(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_one_rank_dies, world_size=2, tmp_path=tmp_path)
    assert time.monotonic() - start < 45, "a dead peer must not cost the full collective timeout"
    assert "rank 1" in str(info.value) and "exited with code 7" in str(info.value)


def _raises_on_rank(rank, world_size):
    if rank == world_size - 1:
        raise ValueError(f"boom on {rank}")
    return rank


def test_harness_reports_rank_traceback(tmp_path):
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 ---.*ValueError: boom on 1"):
        run_distributed(_raises_on_rank, world_size=2, tmp_path=tmp_path)


def _sleeps(rank, world_size):
    time.sleep(60)


def test_harness_deadline(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="did not finish within the 1 s deadline"):
        run_distributed(_sleeps, world_size=2, tmp_path=tmp_path, timeout_s=1)
    assert time.monotonic() - start < 30
