"""The tiny Llama the engine tests serve (built from a config, seeded) and its own greedy
``generate``, the reference every engine's greedy output must equal."""

import torch
import transformers


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def greedy(model, prompt: list[int], tokens: int) -> list[int]:
    """``tokens`` new tokens of ``model.generate`` (greedy, no end of sequence) after ``prompt``."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()
