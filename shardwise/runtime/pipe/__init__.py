"""``deepspeed.runtime.pipe``: see ``shardwise.pipe``."""

from shardwise.parallel.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]
