"""The 1-bit compressed all-reduce on 2 and 4 gloo ranks against a NumPy simulation of the
algorithm ([Note: compressed all-reduce]): the averaged result and both error buffers
after several rounds, sizes that need padding, and the bytes each rank really wrote to
its sockets (``/proc/self/io``), against those of a plain fp32 all-reduce."""

import numpy as np
import pytest
import torch

from shardwise.comm import Communicator, CompressedAllReduce
from shardwise.testing import run_distributed

SIZES = (1, 13, 1000, 4099)
ROUNDS = 4


def _data(numel: int, rank: int, round_: int) -> np.ndarray:
    return np.random.default_rng(1000 * numel + 10 * rank + round_).standard_normal(numel).astype(np.float32)


def _compress(rows: np.ndarray, error: np.ndarray) -> np.ndarray:
    """NumPy reference: ``rows + error`` as sign * per-row scale; updates ``error``."""
    error += rows
    scales = (np.sqrt((error.astype(np.float64) ** 2).sum(-1)) / np.sqrt(error.shape[-1])).astype(np.float32)
    signs = np.where(np.signbit(error), -1.0, 1.0).astype(np.float32)
    # the signs survive a trip through 8-per-byte packing
    signs = np.unpackbits(np.packbits(signs > 0, axis=-1), axis=-1)[..., : signs.shape[-1]] * 2.0 - 1.0
    values = (signs * scales[..., None]).astype(np.float32)
    error -= values
    return values


def _simulate(numel: int, world: int):
    """Every rank's result and error buffers after each round, computed in one process."""
    padded = -(-numel // (8 * world)) * 8 * world
    chunk = padded // world
    worker = [np.zeros((world, chunk), np.float32) for _ in range(world)]
    server = [np.zeros((1, chunk), np.float32) for _ in range(world)]
    results = []
    for round_ in range(ROUNDS):
        sent = []
        for rank in range(world):
            vector = np.zeros(padded, np.float32)
            vector[:numel] = _data(numel, rank, round_)
            sent.append(_compress(vector.reshape(world, chunk), worker[rank]))
        averages = [np.mean([sent[r][j] for r in range(world)], axis=0, dtype=np.float32) for j in range(world)]
        out = np.concatenate([_compress(averages[j][None], server[j])[0] for j in range(world)])
        results.append(out[:numel])
    return results, [w.reshape(-1) for w in worker], [s.reshape(-1) for s in server]


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def _run(rank, world_size):
    comm = Communicator(name="data-parallel", timeout_s=60)
    report = {}
    for numel in SIZES:
        exchange = CompressedAllReduce(comm, numel)
        results = []
        for round_ in range(ROUNDS):
            tensor = torch.from_numpy(_data(numel, rank, round_))
            results.append(exchange(tensor).numpy().copy())
        report[numel] = (results, exchange.worker_error.numpy().copy(), exchange.server_error.numpy().copy())
    # bytes this process wrote to its sockets, compressed against a plain fp32 all-reduce
    numel = 1 << 20
    exchange = CompressedAllReduce(comm, numel)
    tensor = torch.randn(numel)
    exchange(tensor.clone())  # connections and buffers warmed up
    comm.all_reduce(tensor.clone()).wait()
    before = _wchar()
    exchange(tensor.clone())
    compressed = _wchar() - before
    before = _wchar()
    comm.all_reduce(tensor.clone()).wait()
    plain = _wchar() - before
    return report, compressed, plain, dict(comm.bytes)


@pytest.mark.parametrize("world_size", [2, 4])
def test_compressed_all_reduce(tmp_path, world_size):
    reports = run_distributed(_run, world_size=world_size, tmp_path=tmp_path)
    _check_against_simulation(reports, world_size)
    _check_bytes_written(reports, world_size)


def _check_against_simulation(reports, world_size):
    for numel in SIZES:
        expected, workers, servers = _simulate(numel, world_size)
        for rank, (report, *_) in enumerate(reports):
            results, worker, server = report[numel]
            for round_, (got, want) in enumerate(zip(results, expected)):
                np.testing.assert_allclose(
                    got, want, rtol=1e-5, atol=1e-5, err_msg=f"rank {rank}, {numel} elements, round {round_}"
                )
                assert np.array_equal(got, reports[0][0][numel][0][round_]), "ranks disagree"
            np.testing.assert_allclose(worker, workers[rank], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(server, servers[rank], rtol=1e-5, atol=1e-5)
    # the compression is not a no-op, and nothing it drops is lost: the error buffers hold
    # exactly what the results still lack (sum of results = sum of exact averages - mean
    # worker error - server error), which fails if an error buffer is not carried over
    numel = 1000
    exact = [np.mean([_data(numel, r, k) for r in range(world_size)], axis=0) for k in range(ROUNDS)]
    got = reports[0][0][numel][0]
    assert np.abs(got[0] - exact[0]).max() > 0.1
    worker = np.mean([reports[r][0][numel][1] for r in range(world_size)], axis=0)
    server = np.concatenate([reports[r][0][numel][2] for r in range(world_size)])
    np.testing.assert_allclose(np.sum(got, axis=0), np.sum(exact, axis=0) - worker[:numel] - server[:numel], atol=1e-4)


def _check_bytes_written(reports, world_size):
    numel = 1 << 20
    for _, compressed, plain, counted in reports:
        # per phase each rank sends (world - 1) / world of n / 8 bytes (+ scales); a ring
        # all-reduce of fp32 sends 2 (world - 1) / world of 4n
        per_phase = numel / 8 * (world_size - 1) / world_size
        assert 1.9 * per_phase < compressed < 2.3 * per_phase, (compressed, per_phase)
        assert plain / compressed > 14, (plain, compressed)
        assert counted["all_to_all"] > 0 and counted["all_gather"] > 0
