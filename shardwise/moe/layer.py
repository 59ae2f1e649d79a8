"""DeepSpeed's ``MoE`` layer name (mixture of experts is not built in this version)."""

from __future__ import annotations

from torch import nn


class MoE(nn.Module):
    """DeepSpeed's mixture-of-experts layer. Not available in this version of shardwise:
    constructing one raises ``NotImplementedError``."""

    def __init__(self, hidden_size, expert, num_experts=1, ep_size=1, k=1, *args, **kwargs):
        raise NotImplementedError(
            "deepspeed.moe.layer.MoE (mixture of experts) is not available in this "
            "version of shardwise; build the model without MoE layers"
        )
