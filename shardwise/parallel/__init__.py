"""The process grid (data x pipeline x tensor) every parallelism takes its groups from.

See [Note: the grid is the spine] in ``grid.py``.
"""

from shardwise.parallel._expert import ExpertGroups
from shardwise.parallel.grid import ParallelGrid
from shardwise.parallel.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "ExpertGroups",
    "ParallelGrid",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessTopology",
]
