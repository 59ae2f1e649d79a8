"""The one partition rule every ZeRO stage uses.

[Note: bucket partition rule]
Trainable parameters of one optimizer param group and dtype are laid out back to back in
flat buckets (in reverse registration order, which approximates the order backward
produces their gradients). A bucket of ``numel`` elements is padded with zeros to a
multiple of the world size; rank ``r`` owns the contiguous range
``[r * shard_numel, (r + 1) * shard_numel)``. Gradients are reduce-scattered and
parameters all-gathered bucket by bucket with that layout, so each rank's shard of every
buffer is one contiguous slice and one collective serves the whole bucket.
"""

from __future__ import annotations


def partition(numel: int, world_size: int) -> tuple[int, int]:
    """``(padded_numel, shard_numel)`` for a flat buffer of ``numel`` split over ``world_size``."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"cannot partition {numel} elements over {world_size} ranks")
    shard = -(-numel // world_size)
    return shard * world_size, shard
