"""``deepspeed.runtime.pipe.module``: see ``shardwise.pipe.module``."""

from shardwise.pipe.module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec"]
