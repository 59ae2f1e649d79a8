"""Swap-file I/O round-trips tensors of every dtype and refuses files that changed."""

import os

import pytest
import torch

from shardwise.offload import OptimizerSwapper, SwapFileError, SwapIO


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_in_small_blocks_with_several_threads(tmp_path, dtype):
    io = SwapIO(block_size=4096, threads=3)
    tensors = [torch.randn(10_000 + i).to(dtype) for i in range(5)]  # not a multiple of the block
    records = [f.result() for f in [io.write(tmp_path / f"{i}.bin", t) for i, t in enumerate(tensors)]]
    assert [r.nbytes for r in records] == [t.numel() * t.element_size() for t in tensors]
    back = [f.result() for f in [io.read(r) for r in records]]
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))
    assert io.bytes_written == io.bytes_read == sum(r.nbytes for r in records)
    io.close()


def test_truncated_altered_and_missing_files_are_errors(tmp_path):
    io = SwapIO(block_size=4096)
    record = io.write(tmp_path / "x.bin", torch.arange(5000, dtype=torch.float32)).result()
    os.truncate(record.path, record.nbytes - 4)
    with pytest.raises(SwapFileError, match="truncated or overwritten"):
        io.read(record).result()
    record = io.write(tmp_path / "x.bin", torch.arange(5000, dtype=torch.float32)).result()
    with open(record.path, "r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01")
    with pytest.raises(SwapFileError, match="fails its checksum"):
        io.read(record).result()
    record.path.unlink()
    with pytest.raises(SwapFileError, match="cannot be opened"):
        io.read(record).result()
    io.close()


def test_rewriting_a_longer_file_leaves_exactly_the_new_bytes(tmp_path):
    io = SwapIO()
    io.write(tmp_path / "x.bin", torch.zeros(1000)).result()
    record = io.write(tmp_path / "x.bin", torch.ones(10)).result()
    assert (tmp_path / "x.bin").stat().st_size == 40
    assert torch.equal(io.read(record).result(), torch.ones(10))
    io.close()


def test_swapper_steps_sub_groups_like_one_optimizer_step(tmp_path):
    torch.manual_seed(0)
    sizes = [300, 50, 700, 20, 400]
    plain = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    swapped = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    grads = [[torch.randn(n) for n in sizes] for _ in range(3)]
    reference = torch.optim.AdamW(plain, lr=0.1, fused=True)
    optimizer = torch.optim.AdamW(swapped, lr=0.1, fused=True)
    for m in swapped:
        m.grad = torch.zeros_like(m)
    swapper = OptimizerSwapper(
        optimizer, swapped, folder=tmp_path, io=SwapIO(threads=2), sub_group_size=400, buffer_count=2, swap_masters=True
    )
    swapper.swap_out_all()
    assert [len(g) for g in swapper.sub_groups] == [2, 1, 1, 1] and swapper.resident_bytes() == 0
    for step in grads:
        for p, g in zip(plain, step):
            p.grad = g
        reference.step()
        for g_ours, g in zip(swapper.grads, step):
            g_ours.copy_(g)
        seen = []
        swapper.step(lambda indices: seen.append([swapped[i].detach().clone() for i in indices]))
        assert [len(s) for s in seen] == [2, 1, 1, 1]
    assert swapper.resident_bytes() == 0 and all(m.numel() == 0 for m in swapped)  # all on disk
    assert swapper.swapped_bytes() == sum(sizes) * 4 * 3  # master + two moments
    with swapper.resident(list(range(len(sizes)))):
        assert all(torch.equal(a, b) for a, b in zip(plain, swapped))
        assert all(
            torch.equal(reference.state[a]["exp_avg_sq"], optimizer.state[b]["exp_avg_sq"])
            for a, b in zip(plain, swapped)
        )
    swapper.close()
    assert not tmp_path.exists() or not list(tmp_path.glob("*.bin"))
