"""``deepspeed.compression.helper`` (DeepSpeed-Chat's LoRA code): see ``shardwise.utils._modules``."""

from shardwise.utils._modules import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]
