"""Asynchronous, checked reads and writes of tensors to swap files (the nvme tier).

[Note: swap file I/O]
A tensor is written to its own file with ``os.pwrite`` in ``block_size`` requests by a pool
of ``intra_op_parallelism`` threads; reads use ``os.preadv`` into a preallocated tensor,
after asking the kernel to read the whole file ahead (``POSIX_FADV_WILLNEED``), which keeps
many requests in flight as an asynchronous I/O queue would (1 MiB requests one at a time
read at a fifth of the disk's sequential speed here).
Both release the GIL, so I/O overlaps the optimizer step running in the main thread.
Every write records the file's byte count and CRC-32 (computed in the I/O thread, about
3.6 GB/s on one core, an order of magnitude faster than the disks this tier targets);
every read checks both, so a truncated, stale or altered swap file is an error naming the
file instead of silently wrong optimizer state.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch


class SwapFileError(RuntimeError):
    """A swap file could not be written, or what was read back is not what was written."""


@dataclass(frozen=True)
class SwapRecord:
    """What was written to one swap file, to check the read against."""

    path: Path
    numel: int
    dtype: torch.dtype
    nbytes: int
    crc32: int


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (any dtype, bf16 included)."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


class SwapIO:
    """A thread pool that writes tensors to files and reads them back, checked.

    Args:
        block_size: bytes per ``pwrite``/``preadv`` request.
        threads: I/O threads (files in flight are read or written in parallel).
    """

    def __init__(self, *, block_size: int = 1 << 20, threads: int = 1):
        self.block_size = block_size
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardwise-swap")
        self.bytes_written = 0
        self.bytes_read = 0

    def write(self, path: Path, tensor: torch.Tensor) -> Future:
        """Start writing ``tensor`` (contiguous, CPU) to ``path``; the future's result is the
        :class:`SwapRecord`. The caller keeps ``tensor`` unchanged until it completes."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("swap writes take contiguous CPU tensors")
        return self._pool.submit(self._write, Path(path), tensor)

    def _write(self, path: Path, tensor: torch.Tensor) -> SwapRecord:
        data = _byte_view(tensor)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                for start in range(0, len(data), self.block_size):
                    chunk = data[start : start + self.block_size]
                    written = os.pwrite(fd, chunk, start)
                    while written < len(chunk):  # short writes are legal; finish the request
                        written += os.pwrite(fd, chunk[written:], start + written)
                os.ftruncate(fd, len(data))  # a reserved file may be longer than the tensor
            finally:
                os.close(fd)
        except OSError as exc:
            raise SwapFileError(
                f"could not write swap file {path} ({len(data)} bytes): {exc.strerror}; "
                "check free space and permissions of nvme_path"
            ) from exc
        self.bytes_written += len(data)
        return SwapRecord(path, tensor.numel(), tensor.dtype, len(data), zlib.crc32(data))

    def read(self, record: SwapRecord, out: torch.Tensor | None = None) -> Future:
        """Start reading the file ``record`` describes into ``out`` (allocated if None);
        the future's result is the filled tensor, or it raises :class:`SwapFileError`."""
        if out is None:
            out = torch.empty(record.numel, dtype=record.dtype)
        elif out.numel() != record.numel or out.dtype != record.dtype or not out.is_contiguous():
            raise ValueError(
                f"read buffer ({out.numel()} x {out.dtype}) does not match {record.path} "
                f"({record.numel} x {record.dtype})"
            )
        return self._pool.submit(self._read, record, out)

    def _read(self, record: SwapRecord, out: torch.Tensor) -> torch.Tensor:
        data = _byte_view(out)
        try:
            fd = os.open(record.path, os.O_RDONLY)
        except OSError as exc:
            raise SwapFileError(
                f"swap file {record.path} cannot be opened ({exc.strerror}); it was "
                "removed or nvme_path was unmounted while training"
            ) from exc
        try:
            size = os.fstat(fd).st_size
            if size != record.nbytes:
                raise SwapFileError(
                    f"swap file {record.path} has {size} bytes, {record.nbytes} were "
                    "written; it was truncated or overwritten by another process"
                )
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)  # the kernel queues the whole file
            done = 0
            while done < len(data):
                got = os.preadv(fd, [data[done : done + self.block_size]], done)
                if got == 0:
                    raise SwapFileError(f"swap file {record.path} ended after {done} of {record.nbytes} bytes")
                done += got
        finally:
            os.close(fd)
        crc = zlib.crc32(data)
        if crc != record.crc32:
            raise SwapFileError(
                f"swap file {record.path} fails its checksum (crc32 {crc:#010x}, "
                f"written {record.crc32:#010x}): the disk or another process altered "
                "it; the optimizer state in it is lost, resume from the last checkpoint"
            )
        self.bytes_read += len(data)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
