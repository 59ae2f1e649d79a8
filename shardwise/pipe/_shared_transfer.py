"""Pipeline transfers through shared memory between stages on one host.

[Note: pipeline transfers through shared memory]
On gloo a transfer between two CPU stages goes through gloo's threads and a TCP socket,
and the receiver's ``irecv`` waits for the sender's side to be ready. On the 2-core
pipeline benchmark a 256 KiB activation then arrived 2-6 ms after it was sent, most of it
inside the receiver's ``dist.irecv`` call, while an isolated ping-pong of the same tensor
takes 0.1-0.3 ms; that latency sits on the 1F1B loop between the stages
(``bench/results/2026-11-26-cpu-pipeline-zero-bubble.md``). When every stage of a pipe
group runs on one host and the tensors live in CPU memory, the engine sends them through
one file in ``/dev/shm`` that the group maps (``comm/_shm.py``'s ``map_shared_file``)
instead.

The file holds one *ring* per direction and stream (activations, gradients) between
neighbouring stages: a byte buffer with two counters, bytes written (stored by the
sender) and bytes read (stored by the receiver), each on its own 64-byte line. The sender
copies bytes into the free part and then stores the new count; the receiver waits for the
count, copies the bytes out and stores its count. x86-64 keeps each side's stores in
program order, which makes the bytes visible before the count (as in [Note:
shared-memory all-reduce], which also keeps this to x86-64).

A message is its description (the pickled tree structure and each leaf's shape, dtype
and requires_grad, non-tensor leaves' values, as in [Note: pytree transfers with a shape
handshake]), preceded by its length, then each tensor's bytes. No handshake is needed:
the receiver reads the description first, so shapes may change with every message.

Sends never wait for the receiver (two stages sending to each other must not deadlock):
what does not fit into the ring's free space is queued and written as the receiver frees
space, by any later send, any wait of this process (a receive, or the end of the batch)
and ``finish``, which returns once every queued byte is in the ring. A message larger than
the ring streams through it in pieces. A tensor handed to ``send`` is read until then, as
with an asynchronous send.

Waiting spins briefly, then yields the CPU, then sleeps in 50 us steps; it ends with the
usual ``CollectiveError`` (naming the rank and what it waited for) when ``comm.timeout_s``
passes, or at once when the peer's process has exited. ``SHARDWISE_SHM_P2P=0`` turns this
off (transfers then go through the backend).
"""

from __future__ import annotations

import collections
import os
import pickle
import time

import numpy as np
import torch

from shardwise.comm._p2p import count
from shardwise.comm._shm import map_shared_file
from shardwise.pipe._transfer import describe, rebuild

_LINE = 64
"""Bytes between the two counters of a ring (a cache line each)."""
_SETUP = "pipeline shared-memory transfers setup"
_BUDGET = 8 << 20
"""Bytes of ring buffer per pipe group, split among its rings."""
_MIN_RING, _MAX_RING = 256 << 10, 2 << 20
_SPINS, _YIELDS = 100, 1000
"""A wait first checks this many times, then yields the CPU between checks this many
times (about 1-3 ms), then sleeps 50 us between checks: a stage often waits tens of ms."""
_LIVENESS_S = 0.2
"""How often a long wait checks that the peer's process is alive."""


def enabled() -> bool:
    return os.environ.get("SHARDWISE_SHM_P2P", "1").strip() != "0"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class _Ring:
    """One direction of one stream: bytes written by one rank and read by another."""

    def __init__(self, buffer, offset: int, capacity: int):
        self._counts = np.ndarray((2,), dtype=np.int64, buffer=buffer, offset=offset, strides=(_LINE,))
        """Shared: bytes written (stored by the sender only), bytes read (by the receiver only)."""
        self.data = torch.frombuffer(buffer, dtype=torch.uint8, offset=offset + 2 * _LINE, count=capacity)
        self.capacity = capacity
        self.sent = self.received = 0
        """This process's own counts, as the sender and as the receiver."""

    def put(self, src: torch.Tensor) -> int:
        """Copy as much of the 1-D uint8 ``src`` as fits; returns how many bytes."""
        n = min(self.capacity - (self.sent - int(self._counts[1])), src.numel())
        self._copy(src[:n], self.sent, into_ring=True)
        self.sent += n
        self._counts[0] = self.sent
        return n

    def take(self, dst: torch.Tensor) -> int:
        """Copy as much of the available bytes as fit into the 1-D uint8 ``dst``."""
        n = min(int(self._counts[0]) - self.received, dst.numel())
        self._copy(dst[:n], self.received, into_ring=False)
        self.received += n
        self._counts[1] = self.received
        return n

    def _copy(self, part: torch.Tensor, position: int, *, into_ring: bool) -> None:
        start, n = position % self.capacity, part.numel()
        first = min(n, self.capacity - start)
        for ring, flat in ((self.data[start : start + first], part[:first]), (self.data[: n - first], part[first:])):
            if not flat.numel():
                continue
            if into_ring:
                ring.copy_(flat)
            else:
                flat.copy_(ring)


class SharedLinks:
    """The rings of one pipe group, mapped by every stage: build with :func:`open_links`."""

    def __init__(self, buffer, rings: dict[tuple[int, int, int], _Ring], pids: list[int]):
        self._buffer, self.rings, self.pids = buffer, rings, pids
        self.channels: list[SharedChannel] = []

    def flush(self) -> None:
        """Write what every channel of this process has queued, as far as the rings allow."""
        for channel in self.channels:
            if channel.queue:
                channel.flush()


def open_links(comm, device: torch.device) -> SharedLinks | None:
    """Collective over the pipe group ``comm``: the shared rings, or None where the stages
    cannot share memory (see [Note: pipeline transfers through shared memory])."""
    if device.type != "cpu" or comm.world_size == 1:
        return None
    p = comm.world_size
    pairs = sorted({(s, (s + d) % p) for s in range(p) for d in (1, -1)})
    keys = [(a, b, stream) for a, b in pairs for stream in (0, 1)]
    capacity = min(_MAX_RING, max(_MIN_RING, _BUDGET // len(keys) // 4096 * 4096))
    size = _LINE + len(keys) * (2 * _LINE + capacity)
    buffer = map_shared_file(comm, size, purpose="pipe", tag=_SETUP, enabled=enabled())
    if buffer is None:
        return None
    pids = comm.all_gather_object(os.getpid(), tag=_SETUP, counted=False)
    rings = {key: _Ring(buffer, _LINE + i * (2 * _LINE + capacity), capacity) for i, key in enumerate(keys)}
    return SharedLinks(buffer, rings, pids)


class SharedChannel:
    """One stream between this stage and a neighbour through the shared rings; the same
    calls as :class:`~shardwise.pipe._transfer.Channel`."""

    def __init__(self, links: SharedLinks, comm, me: int, peer: int, *, peer_rank: int, what: str, stream: int):
        """``me`` and ``peer``: stages (ranks of the pipe group ``comm``); ``peer_rank``: the
        peer's global rank, for messages."""
        self.links, self.comm, self.peer, self.peer_rank, self.what = links, comm, peer, peer_rank, what
        self._out, self._in = links.rings[(me, peer, stream)], links.rings[(peer, me, stream)]
        self.queue: collections.deque[torch.Tensor] = collections.deque()
        links.channels.append(self)

    # -- sending ----------------------------------------------------------------------------

    def send(self, obj, *, tag: str) -> None:
        leaves, description = describe(obj)
        meta = pickle.dumps(description)
        parts = [
            torch.tensor([len(meta)], dtype=torch.int64).view(torch.uint8),
            torch.frombuffer(bytearray(meta), dtype=torch.uint8),
        ]
        parts += [
            leaf.detach().contiguous().reshape(-1).view(torch.uint8)
            for leaf in leaves
            if isinstance(leaf, torch.Tensor) and leaf.numel()
        ]
        count(self.comm, "send", sum(part.numel() for part in parts), self.peer_rank, tag=f"{self.what} {tag}")
        self.queue.extend(parts)
        self.flush()

    def flush(self) -> None:
        """Write queued bytes while the ring has room."""
        while self.queue:
            head = self.queue[0]
            n = self._out.put(head)
            if n == head.numel():
                self.queue.popleft()
            else:
                self.queue[0] = head[n:]
                return

    def finish(self) -> None:
        """Wait until every queued byte is in the ring."""
        if self.queue:
            self._wait(lambda: self.links.flush() or not self.queue, "send", "at the end of the batch")

    # -- receiving --------------------------------------------------------------------------

    def post_ahead(self) -> None:
        """Nothing to post: a message lands in the ring whenever it is sent."""

    def recv(self, *, tag: str):
        """The next object sent on this stream; floating tensors the sender had requiring
        grad come back requiring grad (leaves of this stage's graph)."""
        length = torch.empty(1, dtype=torch.int64)
        self._read(length.view(torch.uint8), tag)
        blob = torch.empty(int(length), dtype=torch.uint8)
        self._read(blob, tag)
        received = 8 + blob.numel()

        def fill(tensor: torch.Tensor) -> None:
            nonlocal received
            if tensor.numel():
                self._read(tensor.view(-1).view(torch.uint8), tag)
                received += tensor.numel() * tensor.element_size()

        obj = rebuild(pickle.loads(blob.numpy().tobytes()), torch.device("cpu"), fill)
        count(self.comm, "recv", received, self.peer_rank, tag=f"{self.what} {tag}")
        return obj

    def _read(self, dst: torch.Tensor, tag: str) -> None:
        done = self._in.take(dst)
        if done == dst.numel():
            return

        def progress() -> bool:
            nonlocal done
            self.links.flush()
            done += self._in.take(dst[done:])
            return done == dst.numel()

        self._wait(progress, "recv", tag)

    # -- waiting ----------------------------------------------------------------------------

    def _wait(self, ready, op: str, tag: str) -> None:
        """Until ``ready()``; a ``CollectiveError`` naming ``op`` and ``tag`` at the deadline
        or once the peer's process has exited."""
        deadline = time.monotonic() + self.comm.timeout.total_seconds()
        next_check = time.monotonic() + _LIVENESS_S
        checks = 0
        while not ready():
            checks += 1
            if checks <= _SPINS:
                continue
            if checks <= _SPINS + _YIELDS:
                os.sched_yield()
            else:
                time.sleep(5e-5)
            if checks & 63:
                continue
            now = time.monotonic()
            if now > deadline or (now > next_check and not _alive(self.links.pids[self.peer])):
                failure = (
                    None
                    if now > deadline
                    else RuntimeError(f"rank {self.peer_rank}'s process (pid {self.links.pids[self.peer]}) has exited")
                )
                record = count(self.comm, op, 0, self.peer_rank, tag=f"{self.what} {tag} (shared memory)")
                raise self.comm.diagnose(record, failure)
            if now > next_check:
                next_check = now + _LIVENESS_S
