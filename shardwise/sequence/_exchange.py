"""The two all-to-alls of Ulysses: a sequence split becomes a head split and back.

[Note: Ulysses head split]
Each rank of a sequence-parallel group holds a contiguous piece of the sequence (pieces may
differ in length by any amount) with every head. Attention needs every position, so before
it the ranks swap: rank ``r`` receives, from each rank, that rank's positions of the heads
``r`` attends with, and concatenates them in rank order into the whole sequence. After
attention the outputs go back the reverse way. Everything is batch-first ``[b, s, h, d]``;
the all-to-alls move flat buffers with split sizes, so uneven pieces and head counts need
no padding.

Which heads a rank attends with (``HeadSplit``): grouped-query attention pairs ``g`` query
heads with each key/value head, and a query head must meet its key/value head on one rank.
- ``kv_heads >= ranks``: the key/value heads are dealt out in contiguous runs, the first
  ``kv_heads % ranks`` ranks one more (the uneven split), each with its ``g`` query heads.
- ``kv_heads < ranks``: ``ranks / kv_heads`` ranks share each key/value head (it is sent to
  each of them: replicated), and split that head's ``g`` query heads between them. The
  backward of a replicated head sums its copies' gradients.
Any other shape (a rank without a query head, ranks not a multiple of ``kv_heads`` when
there are fewer key/value heads than ranks, query heads not a multiple of key/value heads)
is refused with the numbers and what would work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def communicator(group, *, default=None):
    """``group`` as a Communicator: one given is used as it is; a process group gets the one
    ``shardwise.comm`` keeps for it (made once, with the group's deadline); None means
    ``default()``, or the world when no default is given."""
    from shardwise.comm import Communicator
    from shardwise.comm._functional import _communicator

    if isinstance(group, Communicator):
        return group
    if group is None and default is not None:
        group = default()
    return _communicator(group)


def piece_lengths(comm, local: int, device) -> list[int]:
    """Every rank's number of positions (one all-gather)."""
    if comm.world_size == 1:
        return [local]
    mine = torch.tensor([local], dtype=torch.int64, device=device)
    every = mine.new_empty(comm.world_size)
    comm.all_gather_into_tensor(every, mine, tag="ulysses sequence lengths").wait()
    return every.tolist()


def even_split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` contiguous counts, the first ``total % parts`` one larger."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _runs(sizes: list[int], offset: int = 0) -> list[range]:
    out, start = [], offset
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class HeadSplit:
    """Which query and key/value heads each rank attends with (see [Note: Ulysses head split])."""

    q: tuple[range, ...]
    kv: tuple[range, ...]
    q_heads: int
    kv_heads: int

    @classmethod
    def build(cls, q_heads: int, kv_heads: int, ranks: int) -> HeadSplit:
        if kv_heads <= 0 or q_heads % kv_heads:
            raise ValueError(
                f"sequence parallelism needs the query heads ({q_heads}) to be a multiple of the "
                f"key/value heads ({kv_heads}), as grouped-query attention pairs them"
            )
        group = q_heads // kv_heads
        if q_heads < ranks:
            raise ValueError(
                f"{q_heads} attention heads cannot be split over a sequence-parallel group of {ranks} ranks: "
                f"each rank attends with at least one head; use sequence_parallel_size <= {q_heads}"
            )
        if kv_heads >= ranks:
            kv = _runs(even_split(kv_heads, ranks))
            q = [range(r.start * group, r.stop * group) for r in kv]
            return cls(tuple(q), tuple(kv), q_heads, kv_heads)
        if ranks % kv_heads:
            raise ValueError(
                f"{kv_heads} key/value heads cannot be shared by {ranks} sequence-parallel ranks: with fewer "
                f"key/value heads than ranks, the ranks must be a multiple of them (use a sequence-parallel "
                f"size that divides or is a multiple of {kv_heads})"
            )
        sharing = ranks // kv_heads
        q, kv = [], []
        for head in range(kv_heads):
            q += _runs(even_split(group, sharing), head * group)
            kv += [range(head, head + 1)] * sharing
        return cls(tuple(q), tuple(kv), q_heads, kv_heads)


def _slice(x: torch.Tensor, heads: range) -> torch.Tensor:
    return x[:, :, heads.start : heads.stop]


def to_heads(x: torch.Tensor, comm, lengths: list[int], heads: tuple[range, ...], tag: str) -> torch.Tensor:
    """``[b, lengths[me], H, d]`` (this rank's positions, every head) to ``[b, sum(lengths),
    len(heads[me]), d]`` (every position, this rank's heads)."""
    b, s, _, d = x.shape
    me = comm.rank
    send_sizes = [s * b * len(h) * d for h in heads]
    send = x.new_empty(sum(send_sizes))
    for chunk, h in zip(send.split(send_sizes), heads):  # one copy per head run, no concatenation
        chunk.view(b, s, len(h), d).copy_(_slice(x, h))
    recv_sizes = [n * b * len(heads[me]) * d for n in lengths]
    received = x.new_empty(sum(recv_sizes))
    comm.all_to_all_single(received, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, tag=tag).wait()
    if b == 1:  # the ranks' pieces, in rank order, are already the whole sequence
        return received.view(1, sum(lengths), len(heads[me]), d)
    pieces = [p.view(b, n, len(heads[me]), d) for p, n in zip(received.split(recv_sizes), lengths)]
    return torch.cat(pieces, dim=1)


def to_sequence(
    y: torch.Tensor, comm, lengths: list[int], heads: tuple[range, ...], num_heads: int, tag: str
) -> torch.Tensor:
    """The reverse of :func:`to_heads`: ``[b, S, len(heads[me]), d]`` to ``[b, lengths[me],
    num_heads, d]``; a head held by several ranks (replicated) gets the sum of their parts."""
    b, _, h_me, d = y.shape
    me = comm.rank
    if b == 1:  # rank r's positions are already one run
        send = y.reshape(-1)
    else:
        send = torch.cat([piece.reshape(-1) for piece in y.split(lengths, dim=1)])
    send_sizes = [n * b * h_me * d for n in lengths]
    recv_sizes = [lengths[me] * b * len(h) * d for h in heads]
    received = y.new_empty(sum(recv_sizes))
    comm.all_to_all_single(received, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, tag=tag).wait()
    pieces = [p.view(b, lengths[me], len(h), d) for p, h in zip(received.split(recv_sizes), heads)]
    if all(h.start == (heads[i - 1].stop if i else 0) for i, h in enumerate(heads)) and heads[-1].stop == num_heads:
        return torch.cat(pieces, dim=2)
    out = y.new_zeros(b, lengths[me], num_heads, d)
    for piece, h in zip(pieces, heads):
        out[:, :, h.start : h.stop] += piece
    return out


class ToHeads(torch.autograd.Function):
    """:func:`to_heads`; its backward is :func:`to_sequence` (summing replicated heads)."""

    @staticmethod
    def forward(ctx, x, comm, lengths, heads, tag):
        ctx.comm, ctx.lengths, ctx.heads, ctx.num_heads, ctx.tag = comm, lengths, heads, x.shape[2], tag
        return to_heads(x, comm, lengths, heads, tag)

    @staticmethod
    def backward(ctx, grad):
        out = to_sequence(grad.contiguous(), ctx.comm, ctx.lengths, ctx.heads, ctx.num_heads, ctx.tag + " (backward)")
        return out, None, None, None, None


class ToSequence(torch.autograd.Function):
    """:func:`to_sequence` for heads held once each; its backward is :func:`to_heads`."""

    @staticmethod
    def forward(ctx, y, comm, lengths, heads, num_heads, tag):
        ctx.comm, ctx.lengths, ctx.heads, ctx.tag = comm, lengths, heads, tag
        return to_sequence(y, comm, lengths, heads, num_heads, tag)

    @staticmethod
    def backward(ctx, grad):
        return to_heads(grad.contiguous(), ctx.comm, ctx.lengths, ctx.heads, ctx.tag + " (backward)"), *[None] * 5
