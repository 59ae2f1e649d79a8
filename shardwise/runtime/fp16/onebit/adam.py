"""DeepSpeed's ``deepspeed.runtime.fp16.onebit.adam`` path (an alias)."""

from shardwise.optim.onebit.adam import OneBitAdam

OnebitAdam = OneBitAdam
"""DeepSpeed's spelling of :class:`shardwise.optim.onebit.OneBitAdam`."""

__all__ = ["OneBitAdam", "OnebitAdam"]
