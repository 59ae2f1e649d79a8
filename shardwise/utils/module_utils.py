"""``deepspeed.utils.module_utils``: see ``shardwise.utils._modules``."""

from shardwise.utils._modules import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]
