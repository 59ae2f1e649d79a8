"""All-reduces and all-gathers through shared memory between the ranks of one host.

[Note: shared-memory all-reduce]
On gloo every all-reduce is a round trip through gloo's threads and TCP: about 0.25 ms
between two idle processes and about 0.8 ms inside a tensor-parallel decode loop, where a
step issues two per layer (bench/results/2026-11-25-cpu-inference.md: 17 per token took
13 of 23 ms), and a ZeRO step's all-gather of 27.4M updated parameters, which gloo does as an
all-reduce, takes 85 ms where this takes 26. When every rank of a group runs on one host,
the ranks map one shared file instead (``/dev/shm``), laid out as

- one 64-byte line per rank holding the number of the last exchange it has posted and, per
  parity, what that exchange is (op, dtype, element count: ranks that diverged into
  different collectives get a ``CollectiveError`` naming both instead of summing unrelated
  data);
- two sets (by the parity of that number) of one slot per rank, ``CAPACITY_BYTES`` each;
  a larger tensor goes through in pieces of that size, one numbered exchange each.

All-reduce number ``s``: copy the tensor into this rank's slot of set ``s % 2``, store
``s`` in this rank's line, wait until every line holds at least ``s``, then sum the slots in
rank order into the tensor (fp16 and bf16 in fp32, rounded once: on 4 ranks of random fp16
its largest error against the exact sum was 0.25, gloo's ring sum's 0.56). Every rank adds
the same values in the same order, so all ranks get the same bits. Two sets make a second
barrier unnecessary: a rank can only be writing set ``s % 2`` again (for ``s + 2``) after
every rank posted ``s + 1``, which each did after it finished reading ``s``.

The store of ``s`` is a plain 8-byte store after the slot's copy: x86-64 keeps stores (and
loads) in program order, which is what makes the slot visible before the number; other
architectures are not enabled. A rank that never posts makes the others wait until
``comm.timeout_s`` and raise the usual ``CollectiveError``. Waiting spins for a short while
(the peers of a decode step arrive within microseconds), then yields the CPU, then sleeps
in 0.1 ms steps, so a long wait (a peer saving a checkpoint) does not hold a core.

The mapping is set up collectively on the group's first CPU all-reduce or all-gather: rank 0
creates the file, every rank opens it and checks a random token rank 0 wrote, and the
file is unlinked once all have it open (nothing is left in ``/dev/shm``, even after a
crash). Where that fails (ranks on several hosts, a private ``/dev/shm`` per container),
the group keeps using the backend, decided by all ranks together.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import secrets
import socket
import time

import numpy as np
import torch

logger = logging.getLogger(__name__)

CAPACITY_BYTES = 1 << 20
"""The bytes of one slot: larger tensors go through in pieces of this size, one exchange each."""
_LINE = 64
_SETUP = "shared-memory all-reduce setup"
_SPINS = 2000
"""Checks before waiting starts to yield the CPU."""
_YIELDS = 20000
"""Further checks, each after ``os.sched_yield()``, before waiting sleeps between checks."""
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def supported() -> bool:
    """Whether this platform may use the shared-memory all-reduce (see the note)."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and os.path.isdir("/dev/shm")
        and os.environ.get("SHARDWISE_SHM_ALLREDUCE", "1").strip() != "0"
    )


class CollectiveMismatch(Exception):
    """Ranks posted different collectives to one exchange (they diverged)."""


_OPS = ("all_reduce", "all_gather")
_ALL_DTYPES = (*_DTYPES, torch.bool, torch.uint8, torch.int8, torch.int16, torch.float8_e4m3fn, torch.float8_e5m2)


def _signature(op: str, tensor: torch.Tensor) -> int:
    """``op``, dtype and element count packed in 64 bits (decoded by :func:`_describe`)."""
    dtype = _ALL_DTYPES.index(tensor.dtype) if tensor.dtype in _ALL_DTYPES else 255
    return (_OPS.index(op) << 56) | (dtype << 48) | (tensor.numel() & ((1 << 48) - 1))


def _describe(signature: int) -> str:
    op, dtype, numel = signature >> 56, (signature >> 48) & 255, signature & ((1 << 48) - 1)
    name = str(_ALL_DTYPES[dtype]).removeprefix("torch.") if dtype < len(_ALL_DTYPES) else "another dtype"
    return f"{_OPS[op] if op < len(_OPS) else 'unknown'} ({numel} x {name})"


class SharedMemoryAllReduce:
    """The shared mapping of one group. Build it with :func:`open_shared` (collective).

    ``all_reduce`` and ``all_gather`` return False when a peer did not arrive within the
    timeout and raise :class:`CollectiveMismatch` when the ranks posted different collectives;
    after either, the mapping must not be used again."""

    def __init__(self, buffer: mmap.mmap, rank: int, world_size: int, capacity: int) -> None:
        self._buffer, self.rank, self.world_size, self.capacity = buffer, rank, world_size, capacity
        lines = {"offset": _LINE, "strides": (_LINE,), "buffer": buffer, "dtype": np.int64}
        self._posted = np.ndarray((world_size,), **lines)
        # by parity, as the slots: a peer may already have posted the next exchange
        self._signatures = [
            np.ndarray((world_size,), **{**lines, "offset": _LINE + 8 * (1 + parity)}) for parity in range(2)
        ]
        data = torch.frombuffer(buffer, dtype=torch.uint8, offset=_data_offset(world_size))
        self._slots = data.view(2, world_size, capacity)
        self._seq = 0

    @staticmethod
    def eligible(tensor: torch.Tensor, *, summed: bool = True) -> bool:
        """Whether ``tensor`` (an all-reduce's, or an all-gather's input) can go through here."""
        return tensor.device.type == "cpu" and tensor.is_contiguous() and (tensor.dtype in _DTYPES or not summed)

    def all_reduce(self, tensor: torch.Tensor, timeout_s: float) -> bool:
        """Sum ``tensor`` over the group in place, a slot's worth at a time."""
        signature = _signature("all_reduce", tensor)
        for piece in self._pieces(tensor.view(-1)):
            slots = self._exchange(piece, signature, timeout_s)
            if slots is None:
                return False
            if piece.dtype in (torch.float16, torch.bfloat16):  # in fp32, rounded once
                total = slots[0].float()
                for slot in slots[1:]:
                    total.add_(slot)
                piece.copy_(total)
                continue
            torch.add(slots[0], slots[1], out=piece)
            for peer in range(2, self.world_size):
                piece.add_(slots[peer])
        return True

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, timeout_s: float) -> bool:
        """Every rank's ``tensor`` into the contiguous ``output``, rank-major."""
        signature = _signature("all_gather", tensor)
        rows = output.view(self.world_size, -1)
        start = 0
        for piece in self._pieces(tensor.view(-1)):
            slots = self._exchange(piece, signature, timeout_s)
            if slots is None:
                return False
            for row, slot in zip(rows, slots):
                row[start : start + len(piece)].copy_(slot)
            start += len(piece)
        return True

    def _pieces(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat.split(max(1, self.capacity // flat.element_size())))

    def _exchange(self, piece: torch.Tensor, signature: int, timeout_s: float) -> list[torch.Tensor] | None:
        """Post the 1-D ``piece`` of the collective ``signature`` names and wait for every
        rank's: their slots (``piece``'s dtype)."""
        self._seq += 1
        seq = self._seq
        nbytes = piece.numel() * piece.element_size()
        slots = [slot.view(piece.dtype) for slot in self._slots[seq % 2, :, :nbytes]]
        slots[self.rank].copy_(piece)
        self._signatures[seq % 2][self.rank] = signature
        self._posted[self.rank] = seq
        if not self._wait(seq, timeout_s):
            return None
        signatures = self._signatures[seq % 2].tolist()
        if any(other != signature for other in signatures):
            raise CollectiveMismatch(
                "ranks posted different collectives: "
                + ", ".join(f"rank {rank} {_describe(other)}" for rank, other in enumerate(signatures))
            )
        return slots

    def _wait(self, seq: int, timeout_s: float) -> bool:
        posted = self._posted
        deadline = time.monotonic() + timeout_s
        checks = 0
        while posted.min() < seq:
            checks += 1
            if checks <= _SPINS:
                continue
            if checks & 255 == 0 and time.monotonic() > deadline:
                return False
            if checks <= _SPINS + _YIELDS:
                os.sched_yield()
            else:
                time.sleep(1e-4)
        return True


def _data_offset(world_size: int) -> int:
    return _LINE * (1 + world_size)


def open_shared(comm) -> SharedMemoryAllReduce | None:
    """Collective over ``comm``'s group: the shared mapping, or None on every rank where
    any rank cannot have it (see [Note: shared-memory all-reduce])."""
    slot = CAPACITY_BYTES
    buffer = map_shared_file(
        comm, _data_offset(comm.world_size) + 2 * comm.world_size * slot, purpose="allreduce", tag=_SETUP
    )
    if buffer is None:
        logger.info("%s group: shared-memory all-reduce unavailable (the ranks could not map one file)", comm.name)
        return None
    return SharedMemoryAllReduce(buffer, comm.rank, comm.world_size, slot)


def map_shared_file(comm, size: int, *, purpose: str, tag: str, enabled: bool = True) -> mmap.mmap | None:
    """Collective over ``comm``'s group: one zeroed file of ``size`` bytes in ``/dev/shm``
    mapped by every rank, or None on every rank where any rank cannot map it (another
    host, no ``/dev/shm``, not enough room in it, ``enabled`` false on some rank). The
    group's rank 0 creates it; it is unlinked once every rank has it open, so nothing is
    left behind, even after a crash. The first 8 bytes hold a check token."""
    hosts = comm.all_gather_object((enabled and supported(), _host_id()), tag=tag, counted=False)
    if not all(flag for flag, _ in hosts) or len({host for _, host in hosts}) != 1:
        return None
    path, token = None, 0
    if comm.rank == 0:
        path, token = _create(size, purpose)
    path, token = comm.all_gather_object((path, token), tag=tag, counted=False)[0]
    buffer = None
    if path is not None:
        buffer = _attach(path, size, token)
    opened = comm.all_gather_object(buffer is not None, tag=tag, counted=False)
    if comm.rank == 0 and path is not None:
        os.unlink(path)
    if not all(opened):
        if buffer is not None:
            buffer.close()
        return None
    return buffer


def _create(size: int, purpose: str) -> tuple[str | None, int]:
    path = f"/dev/shm/shardwise-{purpose}-{os.getpid()}-{secrets.token_hex(8)}"
    token = secrets.randbits(62) + 1
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None, 0
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)  # a full /dev/shm refuses here, not with SIGBUS on first touch
        with mmap.mmap(fd, size) as buffer:
            buffer[:8] = token.to_bytes(8, "little")
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None, 0
    os.close(fd)
    return path, token


def _attach(path: str, size: int, token: int) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        buffer = mmap.mmap(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)
    if int.from_bytes(buffer[:8], "little") != token:
        buffer.close()
        return None
    return buffer
