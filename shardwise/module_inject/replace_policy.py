"""``deepspeed.module_inject.replace_policy``: DeepSpeed's policy names for the model
families shardwise has a sharding policy for, bound to those ``TPPolicy`` objects
(``shardwise.tensor_parallel.policies.POLICIES``). DeepSpeed's other families (BERT,
BLOOM, GPT-J, GPT-Neo, Megatron, CLIP, InternLM, UNet, VAE) have none yet."""

from shardwise.tensor_parallel.policies import POLICIES

HFGPT2LayerPolicy = POLICIES["gpt2"]
HFOPTLayerPolicy = POLICIES["opt"]
GPTNEOXLayerPolicy = POLICIES["gpt_neox"]
LLAMALayerPolicy = POLICIES["llama"]
LLAMA2LayerPolicy = POLICIES["llama"]

replace_policies = [GPTNEOXLayerPolicy, HFGPT2LayerPolicy, HFOPTLayerPolicy, LLAMALayerPolicy]
"""The transformer policies, as DeepSpeed lists them (one entry per distinct policy)."""

__all__ = [
    "GPTNEOXLayerPolicy",
    "HFGPT2LayerPolicy",
    "HFOPTLayerPolicy",
    "LLAMA2LayerPolicy",
    "LLAMALayerPolicy",
    "replace_policies",
]
