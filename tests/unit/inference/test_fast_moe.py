"""The fast decoder of Hugging Face MoE families ([Note: the fast MoE MLP]) at tp 1 / ep 1:
the routing rule equals each family's router, and the engine generates the plain model's
greedy tokens with its per-step logits (fp32, batch 1 and a left-padded batch), with the
experts sorted by token (the CPU's way) and with every expert run on every token (the
fixed-shape decode step a CUDA graph captures, run eagerly here)."""

import copy

import pytest
import torch

import shardwise
from shardwise.inference._fast_moe import MoEDecoder, MoEMLP, route
from shardwise.inference._graphs import StaticSteps
from shardwise.testing.causal_lm import MOE_FAMILIES, prompts, tiny_lm

NEW = 16


def _moe_mlps(engine) -> list[MoEMLP]:
    return [layer[4] for layer in engine._decoder.layers if isinstance(layer[4], MoEMLP)]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routing_is_the_family_routers(family):
    reference = tiny_lm(family)
    engine = shardwise.init_inference(copy.deepcopy(reference), dtype=torch.float32, replace_with_kernel_inject=True)
    x = torch.randn(10, reference.config.hidden_size)
    block = reference.model.layers[0].mlp
    with torch.no_grad():
        _, want_weights, want_experts = block.gate(x)
        weights, experts = route(torch.nn.functional.linear(x, block.gate.weight), engine._decoder.routing)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=1e-6)


@pytest.mark.parametrize("sync_free", [False, True], ids=["sorted", "every_expert"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_fast_moe_decoder_generates_what_the_model_generates(family, sync_free):
    reference = tiny_lm(family)
    engine = shardwise.init_inference(copy.deepcopy(reference), dtype=torch.float32, replace_with_kernel_inject=True)
    assert engine.fast_path and isinstance(engine._decoder, MoEDecoder)
    mlps = _moe_mlps(engine)
    assert len(mlps) == (1 if family == "qwen2_moe" else 2)  # Qwen2-MoE's second layer is dense here
    for mlp in mlps:
        mlp.sync_free = sync_free
    if sync_free:  # the decode step with fixed shapes ([Note: decode graphs])
        engine._steps = StaticSteps(engine._decoder, graph=False)
    single, (batch, mask) = prompts()
    with torch.no_grad():  # the model's own forward reads the re-stored expert weights
        want_logits = reference(batch, attention_mask=mask).logits
    torch.testing.assert_close(engine(batch, attention_mask=mask).logits, want_logits, rtol=0, atol=1e-5)
    for ids, kwargs in ((single, {}), (batch, {"attention_mask": mask})):
        kwargs.update(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)
        want, got = reference.generate(ids, **kwargs), engine.generate(ids, **kwargs)
        assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
        assert len(got.logits) == len(want.logits) >= NEW // 2  # eos may end every row early
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-4)


def test_experts_split_for_training_have_no_fast_decoder():
    """Experts split by AutoEP for training move tokens by all-to-all; the decoder, which
    assumes every rank has every token ([Note: experts at inference]), refuses them."""
    from types import SimpleNamespace

    from shardwise.inference._fast import build_decoder
    from shardwise.moe._autoep import split

    model = tiny_lm("mixtral")
    groups = SimpleNamespace(ep_size=2, ep_rank=0, name="ep_size_2", ep_comm=None)
    for layer in model.model.layers:
        split(layer.mlp.experts, groups)
    decoder, why = build_decoder(model)
    assert decoder is None and "split for training" in why, why


def test_qwen2_moe_with_sliding_windows_in_some_layers_has_no_fast_decoder():
    import transformers

    from shardwise.inference._fast import build_decoder

    config = transformers.Qwen2MoeConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        vocab_size=64,
        use_sliding_window=True,
        sliding_window=4,
    )
    assert len(set(config.layer_types)) == 2  # the first layer windowed, the second not
    decoder, why = build_decoder(transformers.AutoModelForCausalLM.from_config(config).eval())
    assert decoder is None and "sliding-window attention in some layers" in why, why
