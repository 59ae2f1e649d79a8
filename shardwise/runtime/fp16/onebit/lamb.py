"""DeepSpeed's ``deepspeed.runtime.fp16.onebit.lamb`` path (an alias)."""

from shardwise.optim.onebit.lamb import OneBitLamb

OnebitLamb = OneBitLamb
"""DeepSpeed's spelling of :class:`shardwise.optim.onebit.OneBitLamb`."""

__all__ = ["OneBitLamb", "OnebitLamb"]
