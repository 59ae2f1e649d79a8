"""Sending a stage's outputs (any pytree) to a neighbour stage, and gradients back.

[Note: pytree transfers with a shape handshake]
What flows between stages may be a tensor, a tuple, a dict, tensors that need no
gradient and non-tensor values, and its shapes may change between micro-batches (a
variable sequence length). Each transfer starts with a two-element header: whether the
description of the payload (tree structure, each leaf's shape / dtype / requires_grad,
non-tensor leaves' values) differs from the previous transfer on this channel, and the
byte length of the new description, which then follows. The tensors follow one by one.
So a steady run of equal shapes costs one 16-byte header per transfer, and a new shape
one extra small message. Sends are asynchronous and their handles are waited on before
the batch ends (a stage never blocks on its own send, which could deadlock two stages
sending to each other); receives are waited on when their data is needed, and the engine
posts each header's receive ahead, once the previous message on the channel has arrived
and the schedule has another one coming (``Channel.post_ahead``). The peers are
the job's own ranks (the description is pickled, as ``all_gather_object`` does).
"""

from __future__ import annotations

import pickle

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from shardwise.comm import Communicator, Handle
from shardwise.comm._p2p import recv, send


def describe(obj) -> tuple[list, tuple]:
    """``obj``'s leaves and its description: the tree structure, and per leaf its shape,
    dtype and requires_grad (tensors) or its value (anything else)."""
    leaves, spec = tree_flatten(obj)
    return leaves, (
        treespec_dumps(spec),
        tuple(
            ("tensor", tuple(x.shape), str(x.dtype).removeprefix("torch."), bool(x.requires_grad))
            if isinstance(x, torch.Tensor)
            else ("value", x)
            for x in leaves
        ),
    )


def rebuild(description, device: torch.device, fill) -> object:
    """The object a description describes: values as sent, and tensors ``fill(tensor)``
    writes into (``fill`` returns whatever must be waited for before they are read, or
    None); floating tensors sent requiring grad come back requiring grad (leaves of this
    stage's graph)."""
    spec, described = description
    leaves, pending = [], []
    for item in described:
        if item[0] == "value":
            leaves.append(item[1])
            continue
        tensor = torch.empty(item[1], dtype=getattr(torch, item[2]), device=device)
        pending.append(fill(tensor))
        leaves.append(tensor)
    for handle in pending:
        if handle is not None:
            handle.wait()
    for leaf, item in zip(leaves, described):
        if item[0] == "tensor":
            leaf.requires_grad_(item[3] and leaf.is_floating_point())
    return tree_unflatten(leaves, treespec_loads(spec))


class Channel:
    """One direction between this stage and one neighbour (``peer``, a global rank)."""

    def __init__(self, comm: Communicator, peer: int, *, what: str, device: torch.device, stream: int = 0):
        self.comm, self.peer, self.what, self.device, self.stream = comm, peer, what, device, stream
        self._sent_meta = None
        self._received_meta = None
        self._header: tuple[torch.Tensor, Handle] | None = None
        """The next message's header receive, posted ahead (:meth:`post_ahead`)."""
        self.pending: list[tuple[Handle, object]] = []
        """Sends in flight with the tensors they read (kept alive until waited on)."""

    def send(self, obj, *, tag: str) -> None:
        leaves, meta = describe(obj)
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        blob = None
        if meta != self._sent_meta:
            blob = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8).to(self.device)
            header[0], header[1] = 1, blob.numel()
            self._sent_meta = meta
        self._send(header, tag)
        if blob is not None:
            self._send(blob, tag)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self._send(leaf.detach().contiguous(), tag)

    def _send(self, tensor: torch.Tensor, tag: str) -> None:
        self.pending.append((send(self.comm, tensor, self.peer, tag=f"{self.what} {tag}", stream=self.stream), tensor))

    def post_ahead(self) -> None:
        """Post the receive of the next message's header now, before its data is needed, so
        the peer's send of it completes when made (gloo matches a send to a posted receive:
        a receive posted only when needed costs a round trip through both ranks' gloo
        threads; torch's own pipeline schedules post ahead too). Only when a next message
        will come, or the receive stays pending."""
        if self._header is None:
            header = torch.empty(2, dtype=torch.int64, device=self.device)
            self._header = (
                header,
                recv(self.comm, header, self.peer, tag=f"{self.what} (next message)", stream=self.stream),
            )

    def recv(self, *, tag: str):
        """The next object sent on this channel; floating tensors the sender had requiring
        grad come back requiring grad (leaves of this stage's graph)."""
        if self._header is None:
            self.post_ahead()
        header, handle = self._header
        self._header = None
        handle.wait()
        if int(header[0]):
            blob = torch.empty(int(header[1]), dtype=torch.uint8, device=self.device)
            recv(self.comm, blob, self.peer, tag=f"{self.what} {tag}", stream=self.stream).wait()
            self._received_meta = pickle.loads(blob.cpu().numpy().tobytes())
        if self._received_meta is None:
            raise RuntimeError(f"{self.what} from rank {self.peer}: no payload description was received")
        return rebuild(
            self._received_meta,
            self.device,
            lambda tensor: recv(self.comm, tensor, self.peer, tag=f"{self.what} {tag}", stream=self.stream),
        )

    def finish(self) -> None:
        """Wait for every send in flight."""
        for handle, _ in self.pending:
            handle.wait()
        self.pending.clear()
