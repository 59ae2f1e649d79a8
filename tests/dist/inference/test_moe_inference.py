"""init_inference with moe.ep_size on 2 gloo ranks: a Mixtral (Hugging Face, from a config)
whose experts are split over the ranks generates the single-process model's greedy
tokens (fp32, a left-padded batch) and logits, each rank holding only its rows of the
stacked expert weights; an ep_size that fits no expert layout is refused."""

import copy

import torch

from shardwise.testing import run_distributed

NEW = 12


def _mixtral():
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        initializer_range=0.3,
        pad_token_id=0,
    )
    return transformers.MixtralForCausalLM(config).eval()


def _body(rank, world_size):
    import shardwise

    reference = _mixtral()
    ids = torch.tensor([[0, 0, 5, 9, 3, 7], [4, 8, 15, 16, 23, 42]])
    mask = (ids != 0).long()
    with torch.no_grad():
        want = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        want_logits = reference(input_ids=ids, attention_mask=mask).logits
    engine = shardwise.init_inference(copy.deepcopy(reference), dtype=torch.float32, moe={"ep_size": 2})
    with torch.no_grad():
        got = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        got_logits = engine(input_ids=ids, attention_mask=mask).logits
    held = engine.module.model.layers[0].mlp.experts.gate_up_proj
    full = reference.model.layers[0].mlp.experts.gate_up_proj
    try:
        shardwise.init_inference(_mixtral(), dtype=torch.float32, moe={"ep_size": 3})
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {
        "tokens": torch.equal(got, want),
        "new": got.shape[1] - ids.shape[1],
        "logits": float((got_logits - want_logits).abs().max()),
        "rows": (held.shape[0], torch.equal(held, full[rank * 2 : rank * 2 + 2])),
        "refused": refused,
    }


def test_moe_inference_splits_experts_and_generates_the_models_tokens(tmp_path):
    for report in run_distributed(_body, world_size=2, tmp_path=tmp_path):
        assert report["tokens"] and report["new"] == NEW, report
        assert report["logits"] < 1e-5, report
        assert report["rows"] == (2, True), report
        assert "ep_size=3 does not divide" in report["refused"], report
