"""The one shard rule every tensor-parallel layer uses.

[Note: tensor-parallel shard rule]
A sharded parameter is the full parameter cut along one dim into ``tp_degree`` equal,
contiguous chunks; rank ``r`` of the tensor group holds chunk ``r``:

- column-parallel linear: weight ``[out, in]`` and bias ``[out]`` along dim 0 (output
  features);
- row-parallel linear: weight ``[out, in]`` along dim 1 (input features); its bias is
  replicated, every tensor rank holds all of it;
- vocab-parallel embedding: weight ``[vocab, dim]`` along dim 0 (vocabulary rows).

Sizes must divide evenly: there is no padding, so a shard's place in the full tensor is
``[index * size, (index + 1) * size)`` and a checkpoint can be resharded from
``(full_shape, dim, index, parts)`` alone. A sharded parameter carries Megatron's marks
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, which ZeRO's norm and
Megatron-style tools read) and shardwise's :class:`ShardInfo` (``tensor_parallel_shard``,
read through :func:`shard_info`). A replicated parameter carries none of them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_MARKS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "tensor_parallel_full_shape",
    "tensor_parallel_shard",
    "sequence_parallel",
    "tensor_parallel_transposed",
)


class ShardInfo(NamedTuple):
    """Where one rank's shard sits in the full parameter."""

    full_shape: torch.Size
    """The shape of the full (unsharded) parameter."""
    dim: int
    """The dim the full parameter is cut along."""
    index: int
    """Which chunk this is: the rank in the tensor group."""
    parts: int
    """How many chunks there are: the tensor-parallel degree."""


def shard_size(size: int, tp_degree: int, *, what: str) -> int:
    """The length of one rank's chunk of ``size``; ``what`` names the size in the error.

    Raises:
        ValueError: ``size`` does not divide evenly by ``tp_degree``.
    """
    if size % tp_degree:
        raise ValueError(
            f"{what}={size} is not divisible by the tensor-parallel degree (group size) "
            f"{tp_degree}; tensor-parallel layers split evenly"
        )
    return size // tp_degree


def take_shard(full: torch.Tensor, *, dim: int, index: int, parts: int) -> torch.Tensor:
    """A contiguous copy of chunk ``index`` of ``parts`` of ``full`` along ``dim`` (a copy,
    so the full tensor can be freed)."""
    size = full.shape[dim] // parts
    return full.narrow(dim, index * size, size).clone(memory_format=torch.contiguous_format)


def mark_sharded(param: torch.Tensor, *, full_shape: torch.Size, dim: int, index: int, parts: int) -> None:
    """Mark ``param`` as chunk ``index`` of ``parts`` of a ``full_shape`` parameter."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1
    param.tensor_parallel_full_shape = torch.Size(full_shape)
    param.tensor_parallel_shard = ShardInfo(torch.Size(full_shape), dim, index, parts)


def shard_info(param: torch.Tensor) -> ShardInfo | None:
    """``(full_shape, dim, index, parts)`` of a tensor-parallel shard; None for a parameter
    every tensor rank holds whole (replicated)."""
    return getattr(param, "tensor_parallel_shard", None)


def copy_marks(source: torch.Tensor, target: torch.Tensor) -> None:
    """Give ``target`` the tensor-parallel marks of ``source`` (``copy.deepcopy`` of an
    ``nn.Parameter`` keeps only its data and ``requires_grad``)."""
    for name in _MARKS:
        if hasattr(source, name):
            setattr(target, name, getattr(source, name))
