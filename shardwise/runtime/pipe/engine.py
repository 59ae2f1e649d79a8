"""``deepspeed.runtime.pipe.engine``: see ``shardwise.pipe.engine``."""

from shardwise.pipe.engine import PipelineEngine

__all__ = ["PipelineEngine"]
