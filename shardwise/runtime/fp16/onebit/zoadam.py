"""DeepSpeed's ``deepspeed.runtime.fp16.onebit.zoadam`` path (an alias)."""

from shardwise.optim.onebit.zoadam import ZeroOneAdam

__all__ = ["ZeroOneAdam"]
