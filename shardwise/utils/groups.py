"""DeepSpeed's ``deepspeed.utils.groups`` accessors for the process groups of training.

This version of shardwise trains data parallel only: the data-parallel group is the
whole world, the model-, tensor- and sequence-parallel degrees are 1. (The data x
pipeline x tensor grid of the 3D-parallelism work will answer these from the grid the
engine uses.) As in DeepSpeed, the accessors need torch.distributed to be started; the
tensor- and sequence-parallel *groups* do not exist without those parallelisms, and
asking for them is an error, as it is in DeepSpeed.
"""

from __future__ import annotations

import torch.distributed as dist


def _require_initialized() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialized; call shardwise.init_distributed() "
                           "or shardwise.initialize() first")


def get_data_parallel_group():
    """The data-parallel process group (here: the world)."""
    _require_initialized()
    return dist.group.WORLD


def get_data_parallel_world_size() -> int:
    return dist.get_world_size(group=get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return dist.get_rank(group=get_data_parallel_group())


def get_tensor_model_parallel_world_size() -> int:
    """1: no tensor parallelism in this version."""
    return 1


def get_tensor_model_parallel_rank() -> int:
    return 0


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's tensor-parallel group (itself)."""
    _require_initialized()
    return dist.get_rank()


def get_tensor_model_parallel_group():
    raise RuntimeError("no tensor-parallel group: this version of shardwise trains data parallel only "
                       "(tensor parallelism is not built yet)")


get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
get_model_parallel_group = get_tensor_model_parallel_group

_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank
_get_sequence_data_parallel_group = get_data_parallel_group
_get_sequence_data_parallel_world_size = get_data_parallel_world_size
_get_sequence_data_parallel_rank = get_data_parallel_rank


def _get_data_parallel_group_ranks():
    _require_initialized()
    return range(dist.get_world_size())


def _get_model_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_world_size() -> int:
    """1: no sequence parallelism in this version."""
    _require_initialized()
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group():
    raise KeyError("No sequence parallel group found: this version of shardwise has no sequence "
                   "parallelism (Ulysses)")


def _get_broadcast_src_rank() -> int:
    return 0
