"""DeepSpeed's ``deepspeed.ops`` names, so scripts that build these optimizers directly
run unchanged (``import shardwise as deepspeed``)."""

from shardwise.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
