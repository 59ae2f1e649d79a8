"""``deepspeed.utils.init_on_device``: see ``shardwise.utils._modules``."""

from shardwise.utils._modules import OnDevice

__all__ = ["OnDevice"]
