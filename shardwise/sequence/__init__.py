"""Sequence parallelism (DeepSpeed-Ulysses): a sequence split over ranks, swapped to a head
split for attention (see [Note: Ulysses head split] in ``_exchange.py``)."""

from shardwise.sequence.layer import DistributedAttention

__all__ = ["DistributedAttention"]
