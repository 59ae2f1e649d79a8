"""``deepspeed.runtime.pipe``: see ``shardwise.pipe``."""

from shardwise.parallel.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from shardwise.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
]
