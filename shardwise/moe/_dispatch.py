"""Moving routed tokens to their experts and back, with nothing padded.

[Note: sorted dispatch]
The kept routes of a rank's tokens are sorted by expert (stably, so an expert sees its
tokens in token order) and the token rows gathered in that order: each expert's tokens are
one contiguous slice. Without expert parallelism every expert runs on its slice. With
``ep_size`` ranks, experts ``r * E_local .. (r + 1) * E_local - 1`` live on expert rank
``r``, so the sorted rows are already grouped by destination: the ranks exchange their
per-expert counts (one small all-to-all), then the rows (an all-to-all with split sizes).
A rank receives, from each source in turn, that source's rows for each of its experts;
a stable sort by local expert makes each expert's rows contiguous again. The outputs go
back the same way, reversed, and each token's output is the weighted sum of its routes'.

Gathering and combining add no atomics on a GPU: a token's rows are gathered per route
and the backward puts each gradient row at its route's own place before summing a token's
``k`` routes (``_GatherRoutes``); the outputs are copied to their routes' places (an
``index_copy``, whose backward is a gather) and weighted per token. Only the per-expert
counts come back to the host (split sizes need them), once per layer.

Capacity only decides which routes are kept (``_gating.py``); a dropped route costs
nothing, and ``drop_tokens=False`` (dropless) is the same path with every route kept.
The all-to-alls run through the expert-parallel Communicator (deadline, names in errors);
their backward is the reverse exchange.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwise.moe._gating import Routes

RunLocal = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""Computes this rank's experts on rows grouped by local expert (``counts[i]`` rows for
local expert ``i``, in order) and returns their outputs in the same order."""


class _Exchange(torch.autograd.Function):
    """All-to-all of rows with split sizes; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, comm, send: list[int], recv: list[int], tag: str):
        ctx.comm, ctx.send, ctx.recv, ctx.tag = comm, send, recv, tag
        return _exchange(comm, x, send, recv, tag)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(ctx.comm, grad, ctx.recv, ctx.send, ctx.tag + " (backward)"), None, None, None, None


def _exchange(comm, x: torch.Tensor, send: list[int], recv: list[int], tag: str) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    comm.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, tag=tag).wait()
    return out


def run_each(experts: list[nn.Module], rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert module on its contiguous slice of ``rows`` (every expert runs, also on
    no rows, so each of its parameters gets a gradient on every rank and step)."""
    outputs = []
    for expert, piece in zip(experts, rows.split(counts)):
        out = expert(piece)
        outputs.append(out[0] if isinstance(out, tuple) else out)
    return torch.cat(outputs)


def dispatch_combine(
    x: torch.Tensor,
    routes: Routes,
    run_local: RunLocal,
    *,
    num_experts: int,
    ep_comm=None,
    tag: str = "moe",
    remote=None,
) -> torch.Tensor:
    """The layer's output for tokens ``x`` [S, M] routed by ``routes`` to ``num_experts``
    experts, of which ``run_local`` computes this rank's (see [Note: sorted dispatch]).
    ``remote`` replaces :func:`_remote_experts` (same arguments), as experts split over
    the tensor group do (``_expert_tp.py``)."""
    s, k = routes.expert.shape
    # sort the routes by expert, dropped ones last; route r is token r // k's j = r % k
    key = torch.where(routes.kept, routes.expert, num_experts).reshape(-1)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    counts_list = counts.tolist()
    route = torch.argsort(key, stable=True)[: sum(counts_list)]
    rows = _GatherRoutes.apply(x, route, k)
    ep_size = 1 if ep_comm is None else ep_comm.world_size
    if ep_size == 1:
        out = run_local(rows, counts_list)
    else:
        out = (remote or _remote_experts)(rows, counts, run_local, ep_comm, tag)
    by_route = out.new_zeros(s * k, out.shape[1]).index_copy(0, route, out).view(s, k, out.shape[1])
    weight = routes.weight.float().unsqueeze(-1)  # 0 for a dropped route
    return (by_route.float() * weight).sum(1).to(out.dtype)


class _GatherRoutes(torch.autograd.Function):
    """``x[route // k]``: each route's token row. The backward puts each row's gradient at
    its route (distinct places) and sums a token's ``k`` routes in fp32: no atomic adds,
    which on a GPU would pile thousands of rows onto the same token rows."""

    @staticmethod
    def forward(ctx, x, route, k: int):
        ctx.save_for_backward(route)
        ctx.k, ctx.tokens = k, x.shape[0]
        return x.index_select(0, torch.div(route, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):
        (route,) = ctx.saved_tensors
        by_route = grad.new_zeros(ctx.tokens * ctx.k, grad.shape[1]).index_copy_(0, route, grad)
        by_route = by_route.view(ctx.tokens, ctx.k, grad.shape[1])
        return by_route.sum(1, dtype=torch.float32).to(grad.dtype), None, None


def _remote_experts(rows, counts, run_local: RunLocal, comm, tag: str) -> torch.Tensor:
    """Send ``rows`` (sorted by global expert) to the ranks holding their experts, run the
    local experts on what arrives, and return the outputs in ``rows``' order."""
    ep_size = comm.world_size
    local = counts.numel() // ep_size
    by_rank = counts.view(ep_size, local)
    arriving = torch.empty_like(by_rank)
    comm.all_to_all_single(arriving, by_rank.contiguous(), tag=f"{tag}: expert counts").wait()
    send, recv = by_rank.sum(1).tolist(), arriving.sum(1).tolist()
    received = _Exchange.apply(rows, comm, send, recv, f"{tag}: tokens to experts")
    # rows arrive by source rank, then local expert: group them by local expert
    local_of_row = torch.arange(local, device=rows.device).repeat(ep_size).repeat_interleave(arriving.reshape(-1))
    regroup = torch.argsort(local_of_row, stable=True)
    out = run_local(received.index_select(0, regroup), arriving.sum(0).tolist())
    out = out.index_select(0, torch.argsort(regroup))
    return _Exchange.apply(out, comm, recv, send, f"{tag}: expert outputs back")
