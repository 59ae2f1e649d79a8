"""DeepSpeed's ``deepspeed.utils.groups`` accessors for the process groups of training.

They answer from the process grid of the engine built last by :func:`shardwise.initialize`
(DeepSpeed keeps the same kind of process-wide record); before any engine exists every
rank is a data-parallel replica: the data-parallel group is the world and the tensor- and
pipeline-parallel sizes are 1. Shardwise's own code never reads these: it gets its groups
from the grid it is handed (see [Note: the grid is the spine] in ``parallel/grid.py``).
As in DeepSpeed, the accessors need torch.distributed to be started, and asking for a
tensor- or sequence-parallel *group* where none exists is an error.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist

_grid_ref = None  # a weak reference to the grid of the engine built last


def _set_grid(grid) -> None:
    """Record ``grid`` as the one these accessors answer from (called by ``initialize``)."""
    global _grid_ref
    _grid_ref = weakref.ref(grid) if grid is not None else None


def _grid():
    _require_initialized()
    return _grid_ref() if _grid_ref is not None else None


def _require_initialized() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized; call shardwise.init_distributed() or shardwise.initialize() first"
        )


def get_data_parallel_group():
    """The data-parallel process group (the world when no grid splits it)."""
    grid = _grid()
    return grid.get_data_parallel_group() if grid is not None else dist.group.WORLD


def get_data_parallel_world_size() -> int:
    return dist.get_world_size(group=get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return dist.get_rank(group=get_data_parallel_group())


def get_tensor_model_parallel_world_size() -> int:
    """The tensor-parallel size (1 without tensor parallelism)."""
    grid = _grid()
    return grid.tensor if grid is not None else 1


def get_tensor_model_parallel_rank() -> int:
    grid = _grid()
    return grid.tensor_rank if grid is not None else 0


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's tensor-parallel group."""
    grid = _grid()
    return grid.get_tensor_model_parallel_src_rank() if grid is not None else dist.get_rank()


def get_tensor_model_parallel_group():
    grid = _grid()
    if grid is None or grid.tensor == 1:
        raise RuntimeError(
            "no tensor-parallel group: the job trains without tensor parallelism "
            "(set tensor_parallel.autotp_size or pass mpu= to initialize())"
        )
    return grid.get_tensor_model_parallel_group()


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
    grid = _grid()
    return grid.get_data_parallel_group_ranks() if grid is not None else range(dist.get_world_size())


def _get_model_parallel_world_size() -> int:
    return get_tensor_model_parallel_world_size()


def _get_sequence_parallel_world_size() -> int:
    """1: no sequence parallelism (Ulysses) in this version."""
    _require_initialized()
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group():
    raise KeyError("No sequence parallel group found: this version of shardwise has no sequence parallelism (Ulysses)")


def _get_broadcast_src_rank() -> int:
    return 0
