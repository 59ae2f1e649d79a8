"""DeepSpeed's ``deepspeed.ops`` names, so scripts that build these optimizers directly
run unchanged (``import shardwise as deepspeed``)."""

from shardwise.ops import adam

__all__ = ["adam"]
