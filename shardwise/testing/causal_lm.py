"""Tiny Hugging Face causal LMs from ``transformers`` configs (no downloads), shared by the
inference tests: heads, key-value heads and vocabulary divide by 4, so tp 1, 2 and 4 all
split them. Needs ``transformers`` (the ``test`` extra)."""

import torch

FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "opt", "gpt_neox")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Mixture-of-experts families: 4 experts (2 per rank at ep 2), top-2."""
VOCAB = 128


def tiny_lm(family: str, *, seed: int = 0):
    """A tiny ``family`` model (eval mode), same weights for
    the same seed on every rank."""
    import transformers

    torch.manual_seed(seed)
    # weights 10x larger than the default initialisation, so that the next-token logits are
    # far apart and a wrong mask or position changes the tokens
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2)
    if family == "llama":  # grouped-query attention, untied head
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            tie_word_embeddings=False,
            **common,
        )
    elif family == "mistral":
        config = transformers.MistralConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            **common,
        )
    elif family == "qwen2":  # biases on q/k/v
        config = transformers.Qwen2Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            **common,
        )
    elif family == "gpt2":  # Conv1D, stacked q/k/v, tied head
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=8, n_positions=128, **common)
    elif family == "opt":
        config = transformers.OPTConfig(
            hidden_size=64,
            ffn_dim=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
            **common,
        )
    elif family == "gpt_neox":
        config = transformers.GPTNeoXConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            max_position_embeddings=128,
            **common,
        )
    elif family in MOE_FAMILIES:
        config = _moe_config(family, common)
    else:
        raise ValueError(family)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # biases start at zero: make them count, so a dropped or doubled bias shows
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.1)
    return model.eval()


def _moe_config(family: str, common: dict):
    import transformers

    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, **common)
    if family == "mixtral":  # always renormalizes the top-k probabilities
        return transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **shape)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96)
    if family == "qwen2_moe":  # a shared expert with a sigmoid gate, no renormalization, the second layer dense
        return transformers.Qwen2MoeConfig(
            shared_expert_intermediate_size=80, mlp_only_layers=[1], norm_topk_prob=False, **moe, **shape
        )
    return transformers.Qwen3MoeConfig(norm_topk_prob=True, attention_bias=True, **moe, **shape)  # query / key norms


def prompts(*, seed: int = 1):
    """A batch of one prompt, and a left-padded batch of three (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    single = torch.randint(3, VOCAB, (1, 7), generator=g)
    batch = torch.randint(3, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(batch)
    mask[0, :4] = 0
    mask[2, :1] = 0
    batch[mask == 0] = 0
    return single, (batch, mask)
