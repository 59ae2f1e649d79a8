"""``init_inference`` at tp 1 on tiny models of every family: the engine gives the plain
model's outputs, greedy tokens and seeded samples (with and without kernel injection, batch
1 and a left-padded batch); arguments the fast path leaves out fall back to the model's own
``generate``; generation past ``max_out_tokens`` and unknown models are refused."""

import copy

import pytest
import torch
from torch import nn

import shardwise
from shardwise.testing.causal_lm import FAMILIES, prompts, tiny_lm

NEW = 32


@pytest.mark.parametrize("inject", [False, True], ids=["plain", "kernel_inject"])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_generates_what_the_model_generates(family, inject):
    reference = tiny_lm(family)
    engine = shardwise.init_inference(copy.deepcopy(reference), dtype=torch.float32, replace_with_kernel_inject=inject)
    assert engine.fast_path == inject
    single, (batch, mask) = prompts()
    out = engine(batch, attention_mask=mask)
    assert type(out) is type(reference(batch, attention_mask=mask))
    with torch.no_grad():
        torch.testing.assert_close(out.logits, reference(batch, attention_mask=mask).logits, rtol=0, atol=1e-5)
    for ids, kwargs in ((single, {}), (batch, {"attention_mask": mask})):
        kwargs.update(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)
        want, got = reference.generate(ids, **kwargs), engine.generate(ids, **kwargs)
        assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
        assert len(got.logits) == len(want.logits) > NEW // 2  # eos may end every row early
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-4)
    stats = engine.last_generation
    assert stats.batch_size == 3 and stats.new_tokens == len(want.logits) and stats.prompt_tokens == batch.shape[1]
    assert 0 < stats.time_to_first_token_s < stats.total_s and stats.tokens_per_s > 0
    for sampling in ({"top_k": 20, "temperature": 0.7}, {"top_p": 0.8}, {}):
        torch.manual_seed(3)
        want = reference.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=True, **sampling)
        torch.manual_seed(3)
        got = engine.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=True, **sampling)
        assert torch.equal(got, want), sampling


def test_fast_path_of_opt_with_norms_after_the_blocks_and_a_narrow_embedding():
    """OPT-350m's layout: LayerNorm after each block, no final norm, project_in / project_out."""
    import transformers

    torch.manual_seed(0)
    config = transformers.OPTConfig(
        hidden_size=64,
        ffn_dim=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        max_position_embeddings=128,
        word_embed_proj_dim=32,
        do_layer_norm_before=False,
        vocab_size=128,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    engine = shardwise.init_inference(copy.deepcopy(reference), dtype=torch.float32, replace_with_kernel_inject=True)
    assert engine.fast_path
    _, (batch, mask) = prompts()
    kwargs = dict(
        attention_mask=mask, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True
    )
    want, got = reference.generate(batch, **kwargs), engine.generate(batch, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-4)


def test_generation_stops_at_eos_and_pads_finished_rows_like_generate():
    reference = tiny_lm("llama")
    engine = shardwise.init_inference(copy.deepcopy(reference), dtype=torch.float32, replace_with_kernel_inject=True)
    _, (batch, mask) = prompts()
    free = reference.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    eos = int(free[1, batch.shape[1] + 3])  # row 1's fourth new token ends that row
    want = reference.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    got = engine.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    assert torch.equal(got, want)
    assert (got[1, batch.shape[1] + 4 :] == 0).all()  # padded after its end


def test_arguments_outside_the_fast_path_use_the_models_generate():
    reference = tiny_lm("gpt2")
    engine = shardwise.init_inference(copy.deepcopy(reference), dtype=torch.float32, replace_with_kernel_inject=True)
    single, _ = prompts()
    for kwargs in ({"num_beams": 3}, {"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}):
        want = reference.generate(single, max_new_tokens=12, do_sample=False, **kwargs)
        assert torch.equal(engine.generate(single, max_new_tokens=12, do_sample=False, **kwargs), want), kwargs


def test_generation_past_max_out_tokens_is_refused():
    engine = shardwise.init_inference(
        tiny_lm("llama"), dtype=torch.float32, replace_with_kernel_inject=True, max_tokens=16
    )
    single, _ = prompts()
    with pytest.raises(ValueError, match=r"reach 27 tokens \(7 prompt \+ 20 new\), more than max_out_tokens=16"):
        engine.generate(single, max_new_tokens=20)
    assert engine.generate(single, max_new_tokens=9).shape == (1, 16)
    plain = shardwise.init_inference(tiny_lm("llama"), dtype=torch.float32, max_out_tokens=16)
    with pytest.raises(ValueError, match="max_out_tokens=16"):
        plain.generate(single, max_new_tokens=20)


def test_default_dtype_is_float16_as_in_deepspeed():
    engine = shardwise.init_inference(tiny_lm("llama"))
    assert engine.module.model.embed_tokens.weight.dtype == torch.float16
    assert shardwise.init_inference(tiny_lm("llama"), dtype="bf16").module.lm_head.weight.dtype == torch.bfloat16


def test_engine_reads_model_attributes_through():
    model = tiny_lm("llama")
    engine = shardwise.init_inference(model, dtype=torch.float32)
    assert engine.module is model and engine.config is model.config
    assert engine.generation_config is model.generation_config and engine.device == model.device
    assert engine.mp_world_size == 1 and not engine.fast_path


def test_unknown_model_at_tp1_needs_no_policy():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    net = Net()
    x = torch.randn(2, 4)
    want = net(x)
    engine = shardwise.init_inference(net, dtype=torch.float32)
    torch.testing.assert_close(engine(x), want)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_fast_path_keeps_a_tied_head_tied_and_stores_it_input_major(family):
    # [Note: tied head, input-major]; the tokens and logits are test_engine_generates_what_the_model_generates'
    engine = shardwise.init_inference(tiny_lm(family), dtype=torch.float32, replace_with_kernel_inject=True)
    head, embedding = engine.module.get_output_embeddings(), engine.module.get_input_embeddings()
    assert head.weight is embedding.weight
    assert head.weight.stride() == (1, head.weight.shape[0])
