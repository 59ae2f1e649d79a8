"""DeepSpeed's ``deepspeed.moe`` names. Mixture-of-experts layers are not built in this
version of shardwise: the helpers that only inspect parameters work (a model without
expert parameters passes through them unchanged), and building an ``MoE`` layer raises
``NotImplementedError`` when called, never at import, so scripts that import these
names without using MoE run."""

from shardwise.moe import layer, utils
from shardwise.moe.layer import MoE

__all__ = ["MoE", "layer", "utils"]
