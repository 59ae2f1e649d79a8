"""Experts split over the grid's tensor-parallel group (``enable_expert_tensor_parallelism``).

[Note: tensor-parallel experts]
With a tensor-parallel grid the layers around an MoE layer are tensor-parallel, so every
tensor rank of a group holds the same tokens, routes them alike and would send them alike.
``MoE(..., enable_expert_tensor_parallelism=True)`` splits each local expert over the
tensor group instead of copying it: its first ``nn.Linear`` layer(s) become column-parallel
(the expert's hidden features split), the last row-parallel (partial products summed over
the tensor group), as a Megatron MLP. Which linear is which follows from the expert's
traced graph (:func:`split_plan`): a linear reading whole features is column-parallel, one
reading split features row-parallel, and everything else must be a row-wise function of
whole or of split features (activations, dropout, products: a SwiGLU's ``w1``/``w3`` are
column, ``w2`` row); the output must be whole. An expert already built from shardwise's
``ColumnParallelLinear`` / ``RowParallelLinear`` over the same group is taken as it is.

The expert groups are those without tensor parallelism (DeepSpeed's
``_create_expert_data_and_model_parallel``): tensor rank ``t`` of an expert rank exchanges
tokens with tensor rank ``t`` of the other expert ranks. Each expert's slices are trained
by the tensor ranks of its expert rank; their gradients are reduced over the
expert-data-parallel group only (each tensor rank holds a different slice). The tensor
ranks of a group must route alike, as they must compute any tensor-parallel layer alike:
same inputs, and the same random state where the gate draws noise.

Where an expert-parallel group spans hosts, tokens are deduplicated across the tensor
group as DeepSpeed's ``drop_tokens`` / ``gather_tokens`` do, without its capacity padding:
of each expert's rows, tensor rank ``t`` sends a ``1 / tp`` share (``shares``) through the
all-to-all; the tensor ranks of an expert rank all-gather what they received, run the split
experts on every row, keep their own share of the outputs for the way back, and the
senders all-gather the outputs again. The gathers move a tensor from "one share per rank"
to "whole on every rank" (backward: take the share), the share-taking the other way
(backward: all-gather): the gradients of a whole tensor are whole on every rank, as the
column-parallel layers' input gradients are after their all-reduce.

That trades ``(tp - 1) / tp`` of the all-to-all's rows for two all-gathers of the rows
over the tensor group: fewer bytes between hosts, more in all (tp 2, ep 2, ``R`` routed
rows per rank: a forward brings a rank about 1.5 R rows instead of R). Where every rank
of the expert-parallel group is on one host, each tensor rank sends all its rows instead
and the split experts run on them alike (``MOELayer.tensor_token_shares`` False, decided
by ``crosses_hosts`` at bind). On 4 CPU ranks of one host (gloo, tp 2 x ep 2, hidden 256,
4x MLP, 8 experts, top-2, 1024 tokens a rank; median of 20 forward and backward steps,
interleaved, on a loaded machine), the layer took 145 to 165 ms with every token, 170 to
225 ms with shares, and 190 to 205 ms with whole experts (no tensor parallelism in them).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
from torch import fx, nn

from shardwise.moe._dispatch import RunLocal, _remote_experts
from shardwise.moe._grouped import _LAST_DIM_SPLITS, _is_rowwise
from shardwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

_FIX = (
    "build the expert as Linear -> row-wise functions -> Linear (or a SwiGLU: w2(act(w1(x)) * w3(x))), or "
    "from shardwise.tensor_parallel ColumnParallelLinear / RowParallelLinear over the grid's tensor group, "
    "or leave enable_expert_tensor_parallelism False"
)


def split_plan(expert: nn.Module, tp: int, *, where: str) -> dict[str, str]:
    """Each ``nn.Linear`` of ``expert`` (qualified name) -> ``"column"`` or ``"row"`` (see
    [Note: tensor-parallel experts]). ``where`` names the expert in errors.

    Raises:
        ValueError: the expert is not made of such layers, or a split size does not
            divide by ``tp``.
    """
    try:
        graph = fx.symbolic_trace(expert)
    except Exception as e:  # noqa: BLE001 - user code may raise anything under tracing
        raise ValueError(f"{where}: cannot trace the expert to split it ({type(e).__name__}: {e}); {_FIX}") from None
    whole: dict[fx.Node, bool] = {}
    plan: dict[str, str] = {}
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            whole[node] = True
        elif node.op == "output":
            result = node.args[0]
            if not isinstance(result, fx.Node) or not whole[result]:
                raise ValueError(
                    f"{where}: the expert's output is not whole features (no row-parallel layer last); {_FIX}"
                )
        else:
            whole[node] = _node_state(node, graph, whole, plan, where)
    if not plan:
        raise ValueError(f"{where}: the expert has no nn.Linear to split; {_FIX}")
    for name, kind in plan.items():
        linear = graph.get_submodule(name)
        size, what = (linear.out_features, "out_features") if kind == "column" else (linear.in_features, "in_features")
        if size % tp:
            raise ValueError(
                f"{where}: {name}.{what}={size} (the expert's hidden size) is not divisible by the "
                f"tensor-parallel size {tp}: each tensor rank holds 1/{tp} of the expert's hidden features; use a "
                f"hidden size divisible by {tp}, or leave enable_expert_tensor_parallelism False"
            )
    return plan


def _node_state(node: fx.Node, graph: fx.GraphModule, whole: dict, plan: dict, where: str) -> bool:
    """Whether ``node``'s value holds whole features (else this rank's split of them)."""
    states = {whole[a] for a in node.all_input_nodes}
    if node.op == "call_module" and type(graph.get_submodule(node.target)) is nn.Linear:
        if node.target in plan or len(node.args) != 1 or node.kwargs:
            raise ValueError(
                f"{where}: nn.Linear {node.target!r} is called more than once or with extra arguments; {_FIX}"
            )
        plan[node.target] = "column" if whole[node.args[0]] else "row"
        return not whole[node.args[0]]
    if not _is_rowwise(node, graph):
        raise ValueError(f"{where}: {_describe(node, graph)} is not a row-wise function or an nn.Linear; {_FIX}")
    splits = node.target in _LAST_DIM_SPLITS or node.target is operator.getitem
    if splits and states == {False}:
        raise ValueError(f"{where}: {_describe(node, graph)} splits features a tensor rank holds a slice of; {_FIX}")
    if len(states) > 1:
        raise ValueError(f"{where}: {_describe(node, graph)} mixes whole and split features; {_FIX}")
    return states.pop() if states else True


def _describe(node: fx.Node, graph: fx.GraphModule) -> str:
    """A node of the traced expert, in words."""
    if node.op == "call_module":
        return f"its module {node.target!r} ({type(graph.get_submodule(node.target)).__name__})"
    if node.op == "get_attr":
        return f"its tensor {node.target!r} used outside an nn.Linear"
    name = getattr(node.target, "__name__", node.target)
    return f"its call of {name}" + (" (a method)" if node.op == "call_method" else "")


def tensor_parallel_layers(module: nn.Module) -> list[nn.Module]:
    """The shardwise column- and row-parallel layers inside ``module``."""
    return [m for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def split_expert(expert: nn.Module, comm, *, where: str) -> dict[nn.Parameter, nn.Parameter]:
    """Replace the linear layers of ``expert`` by this tensor rank's column- and
    row-parallel slices over ``comm`` (the tensor group's Communicator), keeping its
    expert-parameter marks; returns old parameter -> new. An expert already holding
    shardwise tensor-parallel layers is left as it is (its group must be ``comm``'s size)."""
    built = tensor_parallel_layers(expert)
    if built:
        for layer in built:
            if (layer.comm.world_size, layer.comm.rank) != (comm.world_size, comm.rank):
                raise ValueError(
                    f"{where}: its {type(layer).__name__} is split over {layer.comm.world_size} ranks (this rank "
                    f"{layer.comm.rank}), the grid's tensor group over {comm.world_size} (rank {comm.rank}); build "
                    "the expert's layers with group=<the grid passed to initialize>"
                )
        return {}
    replaced = {}
    for name, kind in split_plan(expert, comm.world_size, where=where).items():
        linear = expert.get_submodule(name)
        if kind == "column":
            new = ColumnParallelLinear.from_linear(linear, group=comm, gather_output=False)
        else:
            new = RowParallelLinear.from_linear(linear, group=comm, input_is_parallel=True)
        for attr in ("weight", "bias"):
            old, param = getattr(linear, attr), getattr(new, attr)
            if old is not None:
                for mark in ("allreduce", "group_name"):
                    if hasattr(old, mark):
                        setattr(param, mark, getattr(old, mark))
                replaced[old] = param
        parent, _, leaf = name.rpartition(".")
        setattr(expert.get_submodule(parent), leaf, new)
    return replaced


# -- deduplicated token exchange ----------------------------------------------------------


def crosses_hosts(ep_comm, tensor_comm) -> bool:
    """Whether some expert-parallel group of these tensor ranks spans hosts (collective over
    both groups): then the tensor ranks move shares of the tokens (see [Note:
    tensor-parallel experts])."""
    from shardwise.comm._shm import _host_id

    hosts = ep_comm.all_gather_object(_host_id(), tag="hosts of the expert-parallel group", counted=False)
    spans = tensor_comm.all_gather_object(len(set(hosts)) > 1, tag="expert groups across hosts", counted=False)
    return any(spans)


def share_layout(counts: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """For ``counts[u, g]`` rows of group ``g`` in rank ``u``'s share: where each row of the
    rank-major concatenation of the shares (rank, group, row) sits in the whole tensor,
    whose rows are grouped by group, then rank; and each rank's number of rows."""
    per_group = counts.sum(0)
    start = (per_group.cumsum(0) - per_group).unsqueeze(0) + (counts.cumsum(0) - counts)
    lengths = counts.reshape(-1)
    shift = start.reshape(-1) - (lengths.cumsum(0) - lengths)
    place = torch.arange(int(lengths.sum()), device=counts.device) + shift.repeat_interleave(lengths)
    return place, counts.sum(1).tolist()


def shares(counts: torch.Tensor, parts: int) -> torch.Tensor:
    """``[parts, E]``: rank ``u``'s share of ``counts[e]`` rows, ``counts[e] // parts`` and
    one of the ``counts[e] % parts`` left over, dealt to the ranks in turn across the
    groups, so that the ranks' totals differ by at most one."""
    ranks = torch.arange(parts, device=counts.device).unsqueeze(1)
    left = counts % parts
    first = (left.cumsum(0) - left) % parts  # the rank dealt group e's first left-over row
    return counts // parts + (((ranks - first) % parts) < left).long()


@dataclass(frozen=True)
class _Shares:
    """How the tensor ranks' shares make up a whole tensor (from ``share_layout``)."""

    comm: object
    """The tensor group's Communicator."""
    sizes: list[int]
    """Each rank's number of rows."""
    own: torch.Tensor
    """The rows of the whole tensor that are this rank's share, in share order."""
    source: torch.Tensor
    """For each row of the whole tensor, its row in the all-gather of the shares, each
    padded to ``max(sizes)`` rows."""

    @classmethod
    def of(cls, counts: torch.Tensor, comm, device) -> _Shares:
        """The layout of ``counts[u, g]`` (on the host) rows of group ``g`` in rank ``u``'s share."""
        place, sizes = share_layout(counts)
        most = max(sizes, default=0)
        padded = torch.cat([torch.arange(n) + u * most for u, n in enumerate(sizes)])
        source = torch.empty_like(place).index_copy_(0, place, padded)
        first = sum(sizes[: comm.rank])
        own = place[first : first + sizes[comm.rank]]
        return cls(comm, sizes, own.to(device), source.to(device))

    def gather(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        """The whole tensor from every rank's share ``x``."""
        most = max(self.sizes)
        if most == 0:
            return x.new_empty((0, *x.shape[1:]))
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = x.new_empty((self.comm.world_size * most, *x.shape[1:]))
        self.comm.all_gather_into_tensor(out, padded, tag=tag).wait()
        return out.index_select(0, self.source)


class _TakeShare(torch.autograd.Function):
    """Whole on every tensor rank -> this rank's share (backward: all-gather the shares)."""

    @staticmethod
    def forward(ctx, x, layout: _Shares, tag: str):
        ctx.layout, ctx.tag = layout, tag
        return x.index_select(0, layout.own)

    @staticmethod
    def backward(ctx, grad):
        return ctx.layout.gather(grad, ctx.tag + " (backward)"), None, None


class _GatherShares(torch.autograd.Function):
    """This rank's share -> whole on every tensor rank (backward: take the share)."""

    @staticmethod
    def forward(ctx, x, layout: _Shares, tag: str):
        ctx.layout = layout
        return layout.gather(x, tag)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.layout.own), None, None


def remote_experts(rows, counts, run_local: RunLocal, comm, tag: str, *, tensor) -> torch.Tensor:
    """``_dispatch._remote_experts`` for experts split over ``tensor`` (the tensor group's
    Communicator), each tensor rank moving a ``1 / tp`` share of the rows (see [Note:
    tensor-parallel experts])."""
    share = shares(counts.cpu(), tensor.world_size)
    layout = _Shares.of(share, tensor, rows.device)
    mine = _TakeShare.apply(rows, layout, f"{tag}: tokens of the tensor ranks")
    run = functools.partial(_run_gathered, run_local=run_local, tensor=tensor, tag=tag)
    out = _remote_experts(mine, share[tensor.rank].to(counts.device), run, comm, tag)
    return _GatherShares.apply(out, layout, f"{tag}: outputs of the tensor ranks")


def _run_gathered(rows, counts: list[int], *, run_local: RunLocal, tensor, tag: str) -> torch.Tensor:
    """Run the split local experts on the rows every tensor rank received (``rows``: this
    rank's, ``counts[i]`` for local expert ``i``) and return this rank's rows' outputs."""
    mine = torch.tensor(counts, dtype=torch.int64, device=rows.device)
    every = mine.new_empty(tensor.world_size * mine.numel())
    tensor.all_gather_into_tensor(every, mine, tag=f"{tag}: expert counts of the tensor ranks").wait()
    every = every.view(tensor.world_size, -1).cpu()
    layout = _Shares.of(every, tensor, rows.device)
    whole = _GatherShares.apply(rows, layout, f"{tag}: expert rows of the tensor ranks")
    out = run_local(whole, every.sum(0).tolist())
    return _TakeShare.apply(out, layout, f"{tag}: expert outputs to the tensor ranks")
