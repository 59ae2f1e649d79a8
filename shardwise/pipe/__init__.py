"""``deepspeed.pipe``: pipeline parallelism's public names.

The process topologies live in ``shardwise.parallel`` (the grid every parallelism shares);
they are re-exported here where DeepSpeed's users import them.
"""

from shardwise.parallel.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]
