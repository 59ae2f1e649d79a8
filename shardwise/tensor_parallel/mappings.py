"""The communication of tensor and sequence parallelism, as differentiable functions.

Each function names the forward op and the region it moves a tensor into or out of; its
backward is the op's adjoint (an all-reduce's adjoint is the identity and back, an
all-gather's is a reduce-scatter, a split's is an all-gather). Every function takes the
tensor group's :class:`~shardwise.comm.Communicator` explicitly; on a group of one rank it
returns its input and issues no collective.

Tensor regions split the last dim (hidden features); sequence regions split ``dim``, by
default dim 0 (Megatron's sequence-first ``[s, b, h]`` layout). Splits must be even.
Megatron's names (``copy_to_tensor_model_parallel_region`` and so on) are aliases of the
functions here, with the Communicator as an extra argument.

[Note: collective buffers]
Collectives run on a contiguous copy of their input, never in place on it: the tensor an
autograd function receives (an activation, an incoming gradient) may be held by another
consumer, which must not see it change.
"""

from __future__ import annotations

import torch

from shardwise.comm import Communicator
from shardwise.tensor_parallel._partition import shard_size

# -- the collectives ----------------------------------------------------------------------


def _all_reduce(x: torch.Tensor, comm: Communicator, tag: str) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # See [Note: collective buffers]
    comm.all_reduce(out, tag=tag).wait()
    return out


def _split(x: torch.Tensor, comm: Communicator, dim: int, what: str) -> torch.Tensor:
    size = shard_size(x.shape[dim], comm.world_size, what=what)
    return x.narrow(dim, comm.rank * size, size).clone(memory_format=torch.contiguous_format)


def _all_gather(x: torch.Tensor, comm: Communicator, dim: int, tag: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((comm.world_size * x.shape[0], *x.shape[1:]))
    comm.all_gather_into_tensor(out, x, tag=tag).wait()
    if dim == 0:
        return out
    return torch.cat(out.chunk(comm.world_size, dim=0), dim=dim)


def _reduce_scatter(x: torch.Tensor, comm: Communicator, dim: int, tag: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = shard_size(shape[dim], comm.world_size, what=f"{tag}: dim {dim} length")
    # the collective reduces dim-0 slices; other dims are laid out rank-major along dim 0
    inp = x.contiguous() if dim == 0 else torch.cat(x.chunk(comm.world_size, dim=dim), dim=0)
    out = x.new_empty(shape)
    comm.reduce_scatter_tensor(out, inp, tag=tag).wait()
    return out


# -- the autograd functions ---------------------------------------------------------------


class _CopyToTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm, "tp.copy_to_tensor_region.backward"), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm, "tp.reduce_from_tensor_region")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, name):
        ctx.comm, ctx.dim, ctx.name = comm, dim, name
        return _split(x, comm, dim, f"{name}: dim {dim} length")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.comm, ctx.dim, f"tp.{ctx.name}.backward"), None, None, None


class _GatherFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather(x, comm, x.dim() - 1, "tp.gather_from_tensor_region")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.comm, grad.dim() - 1, "gather_from_tensor_region.backward"), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _all_gather(x, comm, dim, "tp.gather_from_sequence_region")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.comm, ctx.dim, "tp.gather_from_sequence_region.backward"), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _reduce_scatter(x, comm, dim, "tp.reduce_scatter_to_sequence_region")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.comm, ctx.dim, "tp.reduce_scatter_to_sequence_region.backward"), None, None


# -- the public functions -----------------------------------------------------------------


def copy_to_tensor_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Enter the tensor region: ``x`` unchanged forward; its gradient all-reduced (summed)
    over the tensor group backward.

    Use it where every tensor rank consumes the same ``x`` with its own shard of a layer
    (the input of a column-parallel linear), so each rank's partial gradient of ``x``
    adds up to the full one.
    """
    if comm.world_size == 1:
        return x
    return _CopyToTensorRegion.apply(x, comm)


def reduce_from_tensor_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Leave the tensor region: ``x`` all-reduced (summed) over the tensor group forward;
    the gradient passes unchanged backward (every rank already holds the full one).

    Use it on partial sums, such as the output of a row-parallel linear.
    """
    if comm.world_size == 1:
        return x
    return _ReduceFromTensorRegion.apply(x, comm)


def scatter_to_tensor_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Keep this rank's chunk of the last dim of ``x`` forward; all-gather the gradient
    along the last dim backward.

    Raises:
        ValueError: the last dim does not divide by the tensor-parallel degree.
    """
    if comm.world_size == 1:
        return x
    return _ScatterToRegion.apply(x, comm, x.dim() - 1, "scatter_to_tensor_region")


def gather_from_tensor_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """All-gather ``x`` along the last dim (rank order) forward; keep this rank's chunk of
    the gradient backward."""
    if comm.world_size == 1:
        return x
    return _GatherFromTensorRegion.apply(x, comm)


def scatter_to_sequence_region(x: torch.Tensor, comm: Communicator, *, dim: int = 0) -> torch.Tensor:
    """Keep this rank's chunk of ``x`` along the sequence dim forward; all-gather the
    gradient backward.

    Args:
        x: the full sequence, the same on every tensor rank.
        comm: the tensor group.
        dim: the sequence dim (0 for Megatron's ``[s, b, h]``).

    Raises:
        ValueError: the sequence length does not divide by the tensor-parallel degree.
    """
    if comm.world_size == 1:
        return x
    return _ScatterToRegion.apply(x, comm, dim % x.dim(), "scatter_to_sequence_region")


def gather_from_sequence_region(x: torch.Tensor, comm: Communicator, *, dim: int = 0) -> torch.Tensor:
    """All-gather the sequence chunks along ``dim`` forward; reduce-scatter the gradient
    backward (every rank's consumer contributed a partial gradient of the full sequence;
    each rank keeps the sum for its own chunk).

    This is the entry of a column-parallel linear under sequence parallelism, in place of
    :func:`copy_to_tensor_region`; using both would sum the gradient twice.
    """
    if comm.world_size == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, comm, dim % x.dim())


def reduce_scatter_to_sequence_region(x: torch.Tensor, comm: Communicator, *, dim: int = 0) -> torch.Tensor:
    """Sum partial results over the tensor group and keep this rank's sequence chunk
    forward; all-gather the gradient backward.

    This is the exit of a row-parallel linear under sequence parallelism, in place of
    :func:`reduce_from_tensor_region`.

    Raises:
        ValueError: the sequence length does not divide by the tensor-parallel degree.
    """
    if comm.world_size == 1:
        return x
    return _ReduceScatterToSequenceRegion.apply(x, comm, dim % x.dim())


# Megatron-LM's names for the same functions (they take the Communicator here).
copy_to_tensor_model_parallel_region = copy_to_tensor_region
reduce_from_tensor_model_parallel_region = reduce_from_tensor_region
scatter_to_tensor_model_parallel_region = scatter_to_tensor_region
gather_from_tensor_model_parallel_region = gather_from_tensor_region
scatter_to_sequence_parallel_region = scatter_to_sequence_region
gather_from_sequence_parallel_region = gather_from_sequence_region
reduce_scatter_to_sequence_parallel_region = reduce_scatter_to_sequence_region
