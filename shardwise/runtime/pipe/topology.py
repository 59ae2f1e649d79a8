"""``deepspeed.runtime.pipe.topology``: the process topologies and DeepSpeed's grid name.

The code lives in ``shardwise.parallel``; ``PipelineParallelGrid(topology)`` builds a
:class:`~shardwise.parallel.ParallelGrid`.
"""

from __future__ import annotations

import torch.distributed as dist

from shardwise.parallel.grid import ParallelGrid
from shardwise.parallel.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessTopology"]


def PipelineParallelGrid(topology: ProcessTopology | None = None, process_group=None) -> ParallelGrid:  # noqa: N802
    """DeepSpeed's grid constructor: a :class:`ParallelGrid` laid out as ``topology``.
    Without one, DeepSpeed's default: the world's prime factors dealt alternately to the
    pipe and data axes (12 ranks = 2 * 2 * 3: pipe 2 * 3, data 2). ``process_group`` is
    accepted and unused, as in DeepSpeed: the grid spans the whole job."""
    del process_group
    if topology is None:
        pipe = data = 1
        n, factor, primes = dist.get_world_size(), 2, []
        while n > 1:
            while n % factor == 0:
                primes.append(factor)
                n //= factor
            factor += 1
        for i, prime in enumerate(primes):
            if i % 2 == 0:
                pipe *= prime
            else:
                data *= prime
        topology = PipeDataParallelTopology(num_pp=pipe, num_dp=data)
    return ParallelGrid.from_topology(topology)
