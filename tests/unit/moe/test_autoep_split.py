"""AutoEP's split of a Hugging Face MoE model in one process: which blocks it finds, the rows
each expert rank keeps under the same names, and clear errors."""

from types import SimpleNamespace

import pytest
import torch

from shardwise.moe import _autoep


def _mixtral(num_experts=4):
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=num_experts,
        num_experts_per_tok=2,
    )
    return transformers.MixtralForCausalLM(config)


def _groups(ep_size, ep_rank):
    return SimpleNamespace(ep_size=ep_size, ep_rank=ep_rank, name=f"ep_size_{ep_size}", ep_comm=None)


def _values(**section):
    return _autoep.check_expert_parallel({"enabled": True, **section})


def test_blocks_are_found_by_their_stacked_experts_and_the_patterns():
    model = _mixtral()
    assert [n for n, _ in _autoep.find_experts(model, _values())] == [
        "model.layers.0.mlp.experts",
        "model.layers.1.mlp.experts",
    ]
    assert [n for n, _ in _autoep.find_experts(model, _values(moe_layer_pattern=r"layers\.1\."))] == [
        "model.layers.1.mlp.experts"
    ]
    assert _autoep.find_experts(model, _values(preset_model="qwen2_moe")) == []


def test_an_expert_rank_keeps_its_rows_under_the_same_names():
    model = _mixtral()
    experts = model.model.layers[0].mlp.experts
    full = {n: p.detach().clone() for n, p in experts.named_parameters()}
    replaced = _autoep.split(experts, _groups(2, 1))
    assert set(dict(experts.named_parameters())) == set(full)  # names unchanged
    for name, p in experts.named_parameters():
        assert torch.equal(p, full[name][2:4]) and p.allreduce is False and p.group_name == "ep_size_2"
    assert len(replaced) == 2 and experts.num_experts == 2 and experts.global_num_experts == 4
    assert isinstance(experts, _autoep.ExpertParallel)


def test_experts_not_divisible_by_the_size_say_so():
    experts = _mixtral(num_experts=3).model.layers[0].mlp.experts
    with pytest.raises(ValueError, match="has 3 experts, not divisible by expert_parallel.autoep_size=2"):
        _autoep.split(experts, _groups(2, 0))


def test_a_model_without_moe_blocks_is_refused():
    config = SimpleNamespace(raw={"expert_parallel": {"enabled": True, "autoep_size": 2}}, optimizer=None)
    with pytest.raises(ValueError, match="the model has no MoE block with stacked experts"):
        _autoep.apply_autoep(torch.nn.Linear(4, 4), grid=None, config=config)
