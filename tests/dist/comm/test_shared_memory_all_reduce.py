"""The shared-memory all-reduce and all-gather of same-host groups ([Note: shared-memory
all-reduce]): sums equal the rank-order sum bit for bit on every rank, gathers equal the
inputs, skewed ranks never read a slot that is being rewritten, nothing goes through gloo
below the capacity, a missing peer is a CollectiveError within the deadline, and the ranks
fall back to gloo together."""

import glob
import os
import random
import re
import time

import pytest
import torch
import torch.distributed as dist

from shardwise.comm import Communicator, _collectives, _shm
from shardwise.testing import DistributedTestError, run_distributed


def _rank_values(rank, numel, dtype, step):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=generator, dtype=dtype)


def _expected(world_size, numel, dtype, step):
    """The rank-order sum; fp16 and bf16 summed in fp32 and rounded once."""
    low = dtype in (torch.float16, torch.bfloat16)
    values = [_rank_values(peer, numel, dtype, step) for peer in range(world_size)]
    total = values[0].float() if low else values[0]
    for value in values[1:]:
        total = total + value
    return total.to(dtype)


def _sums(rank, world_size, disable_on=None, skew=False, slot_bytes=None):
    if rank == disable_on:
        os.environ["SHARDWISE_SHM_ALLREDUCE"] = "0"
    if slot_bytes is not None:  # tensors over a slot go through in pieces (96 bytes: uneven last pieces of
        _shm.CAPACITY_BYTES = slot_bytes  # every case but the first, e.g. 1000 float32 = 41 x 24 + 16)
    gloo_calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda tensor, *a, **k: gloo_calls.append(tensor.numel()) or real(tensor, *a, **k)
    real_gather = _collectives._all_gather_single
    _collectives._all_gather_single = lambda out, *a, **k: gloo_calls.append(-out.numel()) or real_gather(out, *a, **k)
    comm = Communicator(timeout_s=30, name="tensor-parallel", shared_memory=True)
    cases = [
        (1, torch.float32),
        (1000, torch.float32),
        (777, torch.bfloat16),
        (513, torch.float16),
        (100, torch.float64),
        (257, torch.int64),
        (33, torch.int32),
    ]
    rng = random.Random(rank)
    mismatches = []
    for step in range(60):
        numel, dtype = cases[step % len(cases)]
        if skew and rng.random() < 0.3:
            time.sleep(rng.random() * 0.003)
        tensor = _rank_values(rank, numel, dtype, step)
        comm.all_reduce(tensor, tag=f"step {step}").wait()
        if step == 0:
            gloo_calls.clear()  # the set-up's exchanges (on the first call) are gloo's
        if not torch.equal(tensor, _expected(world_size, numel, dtype, step)):
            mismatches.append(step)
    for step in range(60, 80):  # all-gathers, of every dtype (bool too: nothing is summed)
        numel, dtype = cases[step % len(cases)]
        tensor = _rank_values(rank, numel, dtype, step)
        if step == 79:
            tensor = tensor > 0
        out = torch.empty(world_size * numel, dtype=tensor.dtype)
        comm.all_gather_into_tensor(out, tensor, tag=f"step {step}").wait()
        want = torch.cat([_rank_values(peer, numel, dtype, step) for peer in range(world_size)])
        if not torch.equal(out, want if step < 79 else want > 0):
            mismatches.append(step)
    big = torch.arange(float(_shm.CAPACITY_BYTES // 4 + 3))  # a slot and 3 elements: 2 pieces
    comm.all_reduce(big).wait()
    if not torch.equal(big, torch.arange(float(big.numel())) * world_size):
        mismatches.append("big")
    leftovers = glob.glob("/dev/shm/shardwise-allreduce-*")
    return {
        "mismatches": mismatches,
        "shm": comm._shm is not None,
        "gloo_calls": gloo_calls,
        "calls": dict(comm.calls),
        "leftovers": leftovers,
    }


@pytest.mark.parametrize(
    "world_size, slot_bytes",
    [(2, None), (4, None), (2, 96), (4, 96)],
    ids=["2-ranks", "4-ranks", "2-ranks-96-byte-slots", "4-ranks-96-byte-slots"],
)
def test_sums_are_the_rank_order_sum_on_every_rank(tmp_path, world_size, slot_bytes):
    for result in run_distributed(_sums, world_size=world_size, tmp_path=tmp_path, skew=True, slot_bytes=slot_bytes):
        assert result["mismatches"] == []
        assert result["shm"]
        assert result["gloo_calls"] == []
        assert result["calls"] == {"all_reduce": 61, "all_gather": 20}  # the setup's exchanges are not counted
        assert result["leftovers"] == []


def test_ranks_fall_back_to_gloo_together(tmp_path):
    for result in run_distributed(_sums, world_size=2, tmp_path=tmp_path, disable_on=1):
        assert result["mismatches"] == []
        assert not result["shm"]
        assert len(result["gloo_calls"]) == 80  # all but the first call


def _missing_peer(rank, world_size, failed_flag):
    comm = Communicator(timeout_s=3, name="tensor-parallel", shared_memory=True)
    comm.all_reduce(torch.ones(4), tag="first").wait()
    assert comm._shm is not None
    if rank == 1:  # away until rank 0's deadline has passed: it must not wait for this rank
        give_up = time.monotonic() + 30
        while not os.path.exists(failed_flag) and time.monotonic() < give_up:
            time.sleep(0.05)
        return
    try:
        comm.all_reduce(torch.ones(4), tag="row-parallel output").wait()
    finally:
        open(failed_flag, "w").close()


def test_a_missing_peer_is_a_collective_error_within_the_deadline(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_missing_peer, world_size=2, tmp_path=tmp_path, failed_flag=str(tmp_path / "rank0-done"))
    message = str(info.value)
    assert "CollectiveError" in message
    assert re.search(
        r"rank 0 waited in tensor-parallel group rank 0: all_reduce #\d+ \(4 x float32\) "
        r"\[row-parallel output\] which did not complete within 3 s",
        message,
    ), message
    assert "rank 1: published nothing" in message
    assert time.monotonic() - start < 60  # spawn and imports included; the deadline itself is 3 s


def _different_collectives(rank, world_size):
    comm = Communicator(timeout_s=10, name="tensor-parallel", shared_memory=True)
    comm.all_reduce(torch.ones(4), tag="first").wait()
    if rank == 0:
        comm.all_reduce(torch.ones(8), tag="row-parallel output").wait()
    else:  # diverged: a gather where rank 0 sums
        comm.all_gather_into_tensor(torch.empty(8), torch.ones(4), tag="logits").wait()


def test_ranks_in_different_collectives_get_an_error_naming_both(tmp_path):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_different_collectives, world_size=2, tmp_path=tmp_path)
    message = str(info.value)
    assert "CollectiveError" in message
    assert (
        "failed: ranks posted different collectives: rank 0 all_reduce (8 x float32), rank 1 all_gather (4 x float32)"
    ) in message, message


def _grid_groups(rank, world_size):
    """The grid's tensor and data groups take the shared mapping (pipe x data x tensor = 1 x 2 x 2);
    the data group's ZeRO parameter gather (all_gather_scratch) goes through it too."""
    from shardwise.parallel import ParallelGrid

    gloo_calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda tensor, *a, **k: gloo_calls.append(tensor.numel()) or real(tensor, *a, **k)
    grid = ParallelGrid.build(tensor=2)
    sums = {}
    for axis, comm in (("tensor", grid.tensor_comm), ("data", grid.data_comm)):
        tensor = torch.full((3,), float(rank))
        comm.all_reduce(tensor).wait()
        sums[axis] = (tensor[0].item(), comm._shm is not None)
    buffer = torch.zeros(6)
    shard = buffer.numel() // grid.data_comm.world_size
    buffer[grid.data_comm.rank * shard : (grid.data_comm.rank + 1) * shard] = rank + 1.0
    gloo_calls.clear()  # the set-up exchanges of the first calls above
    grid.data_comm.scratch_gather_min_numel = 0  # on gloo this buffer would be all-reduced
    grid.data_comm.all_gather_scratch(buffer).wait()
    from shardwise.tensor_parallel._comm import as_tensor_comm

    wrapped = as_tensor_comm(grid.tensor_comm.group)  # a bare process group, as a user may pass
    return sums, buffer.tolist(), gloo_calls, grid.pipe_comm._shm_wanted, wrapped._shm_wanted


def test_the_grids_tensor_and_data_groups_use_it(tmp_path):
    for rank, (sums, gathered, gloo_calls, pipe_wanted, wrapped_wanted) in enumerate(
        run_distributed(_grid_groups, world_size=4, tmp_path=tmp_path)
    ):
        tensor_peer, data_peer = rank ^ 1, rank ^ 2  # tensor innermost: groups {0,1},{2,3} and {0,2},{1,3}
        assert sums["tensor"] == (float(rank + tensor_peer), True)
        assert sums["data"] == (float(rank + data_peer), True)
        data_ranks = sorted((rank, data_peer))
        assert gathered == [float(r + 1) for r in data_ranks for _ in range(3)]
        assert gloo_calls == []
        assert not pipe_wanted
        assert wrapped_wanted
