"""``deepspeed.module_inject``: DeepSpeed's per-family policies, as shardwise's AutoTP
sharding policies (``shardwise.tensor_parallel.policies``); see ``replace_policy``."""

from shardwise.module_inject import replace_policy
from shardwise.module_inject.replace_policy import (
    GPTNEOXLayerPolicy,
    HFGPT2LayerPolicy,
    HFOPTLayerPolicy,
    LLAMA2LayerPolicy,
    LLAMALayerPolicy,
    replace_policies,
)

__all__ = [
    "GPTNEOXLayerPolicy",
    "HFGPT2LayerPolicy",
    "HFOPTLayerPolicy",
    "LLAMA2LayerPolicy",
    "LLAMALayerPolicy",
    "replace_policies",
    "replace_policy",
]
