"""DeepSpeed's ``parallel_state_sp``: the sequence-parallel groups as a module-level ``mpu``.

``initialize_sequence_parallel(n)`` builds a process grid whose data axis is split into
sequence groups of ``n`` ranks ([Note: sequence groups]); the getters answer from it, and
``shardwise.initialize(mpu=<this module>)`` trains on that grid.
"""

from __future__ import annotations

import torch.distributed as dist

_GRID = None


def _release_sequence_parallel_groups() -> None:
    global _GRID
    _GRID = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the sequence-parallel and sequence-data-parallel groups (collective)."""
    global _GRID
    from shardwise.parallel import ParallelGrid

    if not dist.is_initialized():
        raise RuntimeError("initialize_sequence_parallel needs torch.distributed; call shardwise.init_distributed()")
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    grid = ParallelGrid.build()
    grid.sequence_groups(sequence_parallel_size)
    _GRID = grid


def shardwise_grid():
    """The grid these groups belong to (what ``shardwise.initialize(mpu=...)`` trains on)."""
    if _GRID is None:
        raise RuntimeError("sequence parallelism is not initialized: call initialize_sequence_parallel(n) first")
    return _GRID


def get_sequence_parallel_group():
    return shardwise_grid().get_sequence_parallel_group()


def get_sequence_data_parallel_group():
    return shardwise_grid().get_sequence_data_parallel_group()


def get_sequence_parallel_world_size() -> int:
    return shardwise_grid().get_sequence_parallel_world_size()


def get_sequence_data_parallel_world_size() -> int:
    return shardwise_grid().get_sequence_data_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    return shardwise_grid().get_sequence_parallel_rank()


def get_sequence_data_parallel_rank() -> int:
    return shardwise_grid().get_sequence_data_parallel_rank()
