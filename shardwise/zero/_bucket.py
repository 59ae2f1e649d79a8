"""The flat buckets stages 1-3 lay parameters out in (see [Note: bucket partition rule]
in ``_partition.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.comm import Communicator, Handle


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@dataclass(eq=False)
class ShardedBucket:
    """Parameters laid out back to back in one flat buffer that is sharded over the
    data-parallel ranks (stages 1-3): its gradients are reduce-scattered and its
    parameters all-gathered with one collective each. See [Note: bucket partition rule]."""

    index: int
    group: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    padded: int
    shard: int
    flat_param: torch.Tensor
    master: nn.Parameter | None = None
    grad_full: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    staging: torch.Tensor | None = None
    out: torch.Tensor | None = None
    handle: Handle | None = None
    ready: set[int] = field(default_factory=set)
    shapes: list[torch.Size] = field(default_factory=list)
    """Parameter shapes (stage 3 empties the parameters themselves while sharded)."""
    comm: Communicator | None = None
    """The ranks the bucket is sharded over and reduced across: the data-parallel group,
    or for expert parameters their expert-data-parallel group (see [Note: expert groups]
    in ``parallel/_expert.py``)."""
    frozen: bool = False
    """Parameters that take no gradient (stage 3's frozen units): gathered like the rest,
    never reduced, stepped or given a gradient shard (``grad_shard`` stays None)."""

    def local(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        return tensor[rank * self.shard : (rank + 1) * self.shard]


def master_is_copy(bucket: ShardedBucket) -> bool:
    """Whether the bucket's master is a separate tensor (fp32 copy of 16-bit parameters,
    or in CPU memory for parameters on a GPU), not a slice of the flat parameters."""
    return not same_storage(bucket.master, bucket.flat_param)
