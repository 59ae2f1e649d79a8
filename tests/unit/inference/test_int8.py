"""``dtype=torch.int8``: every linear layer but the LM head stores int8 weights with one
scale per output channel (a quarter of the float32 bytes), logits stay within 10% of the
float model's largest logit with the same top-1 token on at least 90% of positions, and the
fast path computes what the model's own int8 forward computes."""

import copy

import pytest
import torch
from torch import nn

import shardwise
from shardwise.inference._quant import int8_parts, quantize_weight
from shardwise.testing.causal_lm import FAMILIES, VOCAB, tiny_lm


def _teacher_forced_ids():
    return torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_weights_stay_close_to_the_float_model(family):
    reference = tiny_lm(family)
    engine = shardwise.init_inference(copy.deepcopy(reference), dtype=torch.int8)
    ids = _teacher_forced_ids()
    with torch.no_grad():
        want = reference(ids).logits
    got = engine(ids).logits
    assert got.dtype == torch.float32  # activations stay in float on CPU
    error = (got - want).abs().max().item()
    assert 0 < error <= 0.1 * want.abs().max().item(), error
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    report = engine.int8_report
    assert report["bytes_after"] <= 0.27 * report["bytes_before"]
    quantised = [m for m in engine.module.modules() if int8_parts(m) is not None]
    assert len(quantised) == report["layers"] > 0
    assert all(int8_parts(m)[0].dtype == torch.int8 for m in quantised)
    assert int8_parts(engine.module.get_output_embeddings()) is None


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fast_path_computes_the_models_int8_forward(family):
    plain = shardwise.init_inference(tiny_lm(family), dtype=torch.int8)
    fast = shardwise.init_inference(tiny_lm(family), dtype=torch.int8, replace_with_kernel_inject=True)
    assert fast.fast_path
    kwargs = dict(max_new_tokens=24, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ids = _teacher_forced_ids()[:2, :9]
    want, got = plain.generate(ids, **kwargs), fast.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-4)


def test_quantize_weight_rounds_per_output_channel():
    weight = torch.tensor([[1.0, -0.5, 0.25], [0.01, 0.03, -0.04]])
    q, scale = quantize_weight(weight)
    torch.testing.assert_close(scale, torch.tensor([1.0, 0.04]) / 127)
    assert q[0].tolist() == [127, -64, 32] and q[1].tolist() == [32, 95, -127]
    q_t, scale_t = quantize_weight(weight.t(), out_dim=1)  # Conv1D's [in, out] layout
    assert torch.equal(q_t, q.t()) and torch.equal(scale_t, scale)


def test_model_without_linear_layers_is_refused():
    with pytest.raises(ValueError, match="no nn.Linear, Conv1D or tensor-parallel linear layer"):
        shardwise.init_inference(nn.Sequential(nn.Embedding(8, 4), nn.LayerNorm(4)), dtype=torch.int8)
