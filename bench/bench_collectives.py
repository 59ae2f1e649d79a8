"""Time of each collective kind on one buffer, on N gloo ranks (CPU).

    python bench/bench_collectives.py --numel 6500000,27400000 --world-size 2

For each size: all-reduce, reduce-scatter, all-gather, and shardwise's scratch forms
(``Communicator.reduce_scatter_scratch`` / ``all_gather_scratch``, which on gloo run as
all-reduces: see [Note: gloo reduce-scatter and all-gather by all-reduce] in
``shardwise/comm/_collectives.py``), alternated in rounds; medians in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from shardwise.comm import Communicator
from shardwise.testing import run_distributed


def _time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _bench(rank, world_size, sizes, repeats, rounds):
    torch.manual_seed(rank)
    comm = Communicator(name="bench", check_hangs=False)
    out = {}
    for numel in sizes:
        numel -= numel % world_size
        data = torch.randn(numel)
        shard = torch.empty(numel // world_size)
        full = torch.empty(numel)
        kinds = {
            "all_reduce": lambda: comm.all_reduce(data).wait(),
            "reduce_scatter": lambda: comm.reduce_scatter_tensor(shard, data).wait(),
            "all_gather": lambda: comm.all_gather_into_tensor(full, shard).wait(),
            "reduce_scatter_scratch": lambda: comm.reduce_scatter_scratch(data)[0].wait(),
            "all_gather_scratch": lambda: comm.all_gather_scratch(full).wait(),
        }
        times = {kind: [] for kind in kinds}
        for _ in range(rounds):
            for kind, fn in kinds.items():
                fn()  # warm-up
                times[kind] += _time(fn, repeats)
        out[numel] = {kind: 1000 * statistics.median(t) for kind, t in times.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", default="6500000,27400000", help="buffer sizes (fp32 elements)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(float(n)) for n in args.numel.split(",")]
    result = run_distributed(
        _bench, world_size=args.world_size, timeout_s=1800, sizes=sizes, repeats=args.repeats, rounds=args.rounds
    )[0]
    kinds = list(next(iter(result.values())))
    print(f"| fp32 elements | {' | '.join(kinds)} |")
    print("| --- |" + " --- |" * len(kinds))
    for numel, row in result.items():
        print(f"| {numel:,} | " + " | ".join(f"{row[k]:.1f}" for k in kinds) + " |")


if __name__ == "__main__":
    main()
