"""Point-to-point transfers with the same deadline and diagnosis as the collectives.

A send or receive between pipeline stages goes through the pipe axis' Communicator: it
is numbered, counted and waited on with ``comm.timeout`` like any collective, so a peer
that died or diverged is named instead of the job hanging (see [Note: deadlines on every
collective] in ``_deadline.py``). ``peer`` is a global rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.comm._collectives import Communicator, Handle


def send(comm: Communicator, tensor: torch.Tensor, peer: int, *, tag: str = "", stream: int = 0) -> Handle:
    """Start sending ``tensor`` (contiguous) to global rank ``peer``. Messages between
    two ranks are matched in order within one ``stream`` (torch.distributed's tag)."""
    record = comm._record("send", tensor, f"to rank {peer}" + (f", {tag}" if tag else ""))
    return Handle(
        comm,
        dist.isend(tensor, dst=peer, group=comm.group, tag=stream),
        record,
        honours_timeout=comm.gloo_waits_natively,
    )


def recv(comm: Communicator, tensor: torch.Tensor, peer: int, *, tag: str = "", stream: int = 0) -> Handle:
    """Start receiving into ``tensor`` (contiguous) from global rank ``peer``."""
    record = comm._record("recv", tensor, f"from rank {peer}" + (f", {tag}" if tag else ""))
    return Handle(
        comm,
        dist.irecv(tensor, src=peer, group=comm.group, tag=stream),
        record,
        honours_timeout=comm.gloo_waits_natively,
    )


def count(comm: Communicator, op: str, nbytes: int, peer: int, *, tag: str = ""):
    """Number and count a ``"send"`` or ``"recv"`` of ``nbytes`` with global rank ``peer``
    that does not go through the backend (pipeline transfers through shared memory); the
    record names it in a ``comm.diagnose`` error."""
    direction = "to" if op == "send" else "from"
    return comm._record(
        op,
        torch.empty(nbytes, dtype=torch.uint8, device="meta"),
        f"{direction} rank {peer}" + (f", {tag}" if tag else ""),
    )
