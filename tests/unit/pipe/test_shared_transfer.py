"""Pipeline transfers through shared memory ([Note: pipeline transfers through shared
memory]), in one process: two channels facing each other over the same rings (stage 0 and
stage 1) carry any pytree, shapes that change every message, messages larger than the
ring and more bytes than it holds in total, in order; a wait ends at the deadline or
when the peer's process has exited, with the rank and the transfer named."""

import mmap
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from shardwise.pipe import _shared_transfer as st


class FakeComm:
    """What a channel uses of the pipe group's Communicator."""

    def __init__(self, timeout_s=30.0):
        self.timeout = timedelta(seconds=timeout_s)
        self.records = []

    def _record(self, op, tensor, tag):
        self.records.append((op, tensor.numel(), tag))
        return (op, tag)

    def diagnose(self, record, exc):
        op, tag = record
        return RuntimeError(f"waited in {op} [{tag}]: " + ("timed out" if exc is None else str(exc)))


def _pair(capacity=4096, pids=None, timeout_s=30.0):
    keys = [(0, 1, 0), (1, 0, 0)]
    size = st._LINE + len(keys) * (2 * st._LINE + capacity)
    buffer = mmap.mmap(-1, size)
    rings = {key: st._Ring(buffer, st._LINE + i * (2 * st._LINE + capacity), capacity) for i, key in enumerate(keys)}
    links = st.SharedLinks(buffer, rings, pids or [os.getpid(), os.getpid()])
    comm = FakeComm(timeout_s)
    first = st.SharedChannel(links, comm, 0, 1, peer_rank=5, what="stage 0 <-> stage 1 activation", stream=0)
    second = st.SharedChannel(links, comm, 1, 0, peer_rank=4, what="stage 1 <-> stage 0 activation", stream=0)
    return first, second, comm


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert a.requires_grad == b.requires_grad and torch.equal(a.detach(), b.detach())
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key])
    else:
        assert a == b


def test_pytrees_of_changing_shapes_arrive_in_order_through_a_small_ring():
    g = torch.Generator().manual_seed(0)
    messages = []
    for seq in (3, 9, 1, 40, 7):  # 40 x 33 fp32 rows are 5280 bytes: larger than the 4096-byte ring
        messages.append(
            (
                torch.randn(seq, 33, generator=g).requires_grad_(),
                {
                    "mask": torch.rand(seq, generator=g) > 0.5,
                    "pos": torch.arange(seq),
                    "half": torch.randn(2, seq, generator=g).to(torch.bfloat16),
                },
                None,
                "text",
                seq,
                torch.empty(0, 4),
            )
        )
    messages.append(torch.randn(1000, generator=g))
    sender, receiver, comm = _pair()
    for message in messages:  # queued: far more bytes than the ring holds
        sender.send(message, tag="m")
    assert sender.queue  # the rest waits for the receiver
    for message in messages:
        _same(message, receiver.recv(tag="r"))  # each wait writes more of the sender's queue
    sender.finish()
    assert not sender.queue
    sent = [n for op, n, _ in comm.records if op == "send"]
    assert sent == [n for op, n, _ in comm.records if op == "recv"] and len(sent) == len(messages)


def test_both_directions_queue_without_deadlock():
    """Two stages sending each other more than a ring holds before either receives: sends
    never wait, and a receive's wait writes this process's queued bytes."""
    first, second, _ = _pair(capacity=1024)
    a, b = torch.randn(900), torch.randn(700)
    first.send(a, tag="a")
    second.send(b, tag="b")
    _same(b, first.recv(tag="b"))
    _same(a, second.recv(tag="a"))


def test_a_wait_ends_at_the_deadline_naming_the_peer_and_the_transfer():
    _, receiver, _ = _pair(timeout_s=0.3)
    with pytest.raises(
        RuntimeError,
        match=r"waited in recv \[from rank 4, stage 1 <-> stage 0 activation "
        r"micro-batch 3 \(shared memory\)\]: timed out",
    ):
        receiver.recv(tag="micro-batch 3")


def test_a_wait_ends_soon_after_the_peers_process_exits():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)
    assert not st._alive(dead) and st._alive(os.getpid())
    _, receiver, _ = _pair(pids=[dead, os.getpid()], timeout_s=600)
    with pytest.raises(RuntimeError, match=rf"rank 4's process \(pid {dead}\) has exited"):
        receiver.recv(tag="micro-batch 0")


def test_the_group_falls_back_where_shared_memory_is_off(monkeypatch):
    monkeypatch.setenv("SHARDWISE_SHM_P2P", "0")
    assert not st.enabled()
    monkeypatch.setenv("SHARDWISE_SHM_P2P", "1")
    assert st.enabled()
    assert st.open_links(object(), torch.device("meta")) is None  # not CPU memory: the backend carries it
