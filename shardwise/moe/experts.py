"""DeepSpeed's ``Experts``: a rank's local experts, copies of one expert module."""

from __future__ import annotations

import copy

import torch
from torch import nn


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert`` as ``deepspeed_experts.<i>``; their
    parameters are marked as expert parameters (``allreduce = False``, ``group_name``),
    which reduces their gradients over the expert-data-parallel group only.

    ``forward`` takes DeepSpeed's buffer ``[..., num_local_experts * C, M]`` split into
    equal chunks along dim 1; :class:`~shardwise.moe.layer.MoE` does not use it (it runs
    each expert on exactly its tokens, see ``_dispatch.py``)."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for local in self.deepspeed_experts:
            for param in local.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)
