"""NVMe-tier swap bandwidth against the disk's own sequential bandwidth.

Writes and reads ``--gib`` GiB of fp32 tensors through shardwise's swap-file I/O
(``shardwise.offload.SwapIO``: thread pool, block-sized pwrite/preadv, CRC-32 on write and
checked on read), and moves the same bytes with a plain sequential write, a plain
sequential read and ``cp``. Every measurement ends with the data on the disk (fsync) and
every read starts cold (the file's pages dropped with posix_fadvise), so the numbers are
the disk's, not the page cache's.

    python bench/bench_swap.py --dir /local_nvme --gib 2 --out bench/results/<date>-cpu-swap.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from shardwise.offload import SwapIO

CHUNK = 64 << 20  # bytes per tensor / file, like one sub-group's state tensor


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _sync_files(paths) -> None:
    for p in paths:
        _drop_cache(p)


def plain_write(folder: Path, tensors) -> float:
    path = folder / "plain.bin"
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            f.write(memoryview(t.numpy()).cast("B"))
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    _drop_cache(path)
    return elapsed


def plain_read(folder: Path, nbytes: int) -> float:
    path = folder / "plain.bin"
    _drop_cache(path)
    buf = bytearray(CHUNK)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - start


def plain_copy(folder: Path) -> float:
    src, dst = folder / "plain.bin", folder / "copy.bin"
    _drop_cache(src)
    start = time.perf_counter()
    subprocess.run(["cp", str(src), str(dst)], check=True)
    _drop_cache(dst)  # includes the fsync
    elapsed = time.perf_counter() - start
    dst.unlink()
    return elapsed


def swap_write(folder: Path, tensors, threads: int, block: int) -> tuple[float, list]:
    io = SwapIO(block_size=block, threads=threads)
    paths = [folder / f"swap{i}.bin" for i in range(len(tensors))]
    start = time.perf_counter()
    records = [f.result() for f in [io.write(p, t) for p, t in zip(paths, tensors)]]
    _sync_files(paths)  # fsync + drop, so the time counts reaching the disk
    elapsed = time.perf_counter() - start
    io.close()
    return elapsed, records


def swap_read(records, threads: int, block: int) -> float:
    io = SwapIO(block_size=block, threads=threads)
    _sync_files([r.path for r in records])
    outs = [torch.empty(r.numel, dtype=r.dtype) for r in records]
    start = time.perf_counter()
    for f in [io.read(r, o) for r, o in zip(records, outs)]:
        f.result()  # checks size and CRC-32
    elapsed = time.perf_counter() - start
    io.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--block", type=int, default=1 << 20, help="aio.block_size in bytes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _machine import cpu_model

    nbytes = int(args.gib * (1 << 30)) // CHUNK * CHUNK
    tensors = [torch.randn(CHUNK // 4) for _ in range(nbytes // CHUNK)]
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        for _ in range(args.repeats):
            rows.setdefault("plain sequential write", []).append(plain_write(folder, tensors))
            rows.setdefault("plain sequential read", []).append(plain_read(folder, nbytes))
            rows.setdefault("cp (read + write)", []).append(plain_copy(folder))
            for threads in (int(t) for t in args.threads.split(",")):
                elapsed, records = swap_write(folder, tensors, threads, args.block)
                rows.setdefault(f"shardwise swap write, {threads} thread(s)", []).append(elapsed)
                rows.setdefault(f"shardwise swap read, {threads} thread(s)", []).append(
                    swap_read(records, threads, args.block)
                )
                for r in records:
                    r.path.unlink()
    gbps = {name: nbytes / statistics.median(times) / 1e9 for name, times in rows.items()}
    disk = (
        subprocess.run(["df", args.dir or tempfile.gettempdir()], capture_output=True, text=True)
        .stdout.splitlines()[-1]
        .split()[0]
    )
    lines = [
        f"# Swap bandwidth, {nbytes / 2**30:.1f} GiB in {CHUNK >> 20} MiB files, block {args.block} B",
        "",
        f"{date.today()} | {cpu_model()} ({os.cpu_count()} cores) | disk {disk} | torch {torch.__version__} | "
        f"median of {args.repeats}; fsync'd writes, cold-cache reads",
        "",
        "| what | GB/s | vs plain write | vs plain read |",
        "| --- | --- | --- | --- |",
    ]
    for name, value in gbps.items():
        lines.append(
            f"| {name} | {value:.3f} | {value / gbps['plain sequential write']:.2f}x | "
            f"{value / gbps['plain sequential read']:.2f}x |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table)


if __name__ == "__main__":
    main()
