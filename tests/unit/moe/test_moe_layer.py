"""The MoE layer in one process: DeepSpeed's gating rules (capacity, which routes a full
expert drops, weights, l_aux, counts), the sorted dispatch against a per-token loop,
DeepSpeed's names and arguments, and clear errors."""

import math

import pytest
import torch
from torch import nn

from shardwise.moe import _gating
from shardwise.moe.layer import MoE
from shardwise.moe.sharded_moe import TopKGate, top1gating, top2gating, topkgating
from shardwise.moe.utils import (
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)

HIDDEN = 8


def _expert():
    return nn.Sequential(nn.Linear(HIDDEN, 12), nn.GELU(), nn.Linear(12, HIDDEN))


def _moe(**kwargs):
    torch.manual_seed(0)
    options = {"num_experts": 4, "use_rts": False, "top2_2nd_expert_sampling": False, "min_capacity": 1}
    moe = MoE(HIDDEN, _expert(), **{**options, **kwargs})
    for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
        torch.manual_seed(10 + i)
        for p in expert.parameters():
            nn.init.normal_(p, std=0.4)
    return moe


def _per_token(moe, x):
    """The layer's output computed one route at a time."""
    tokens = x.reshape(-1, HIDDEN)
    routes = moe.deepspeed_moe.gate.route(tokens)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    rows = []
    for s in range(tokens.shape[0]):
        row = torch.zeros(HIDDEN)
        for j in range(routes.expert.shape[1]):
            if routes.kept[s, j]:
                row = row + routes.weight[s, j] * experts[int(routes.expert[s, j])](tokens[s : s + 1])[0]
        rows.append(row)
    return torch.stack(rows).reshape(x.shape)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_sorted_dispatch_equals_routing_each_token(k, drop_tokens):
    moe = _moe(k=k, drop_tokens=drop_tokens, capacity_factor=0.5)
    x = torch.randn(3, 5, HIDDEN, requires_grad=True)
    out, l_aux, counts = moe(x)
    expected = _per_token(moe, x)
    assert torch.allclose(out, expected, atol=1e-6)
    grads = torch.autograd.grad(out.sum(), [x, *moe.parameters()], allow_unused=True)
    expected_grads = torch.autograd.grad(expected.sum(), [x, *moe.parameters()], allow_unused=True)
    for got, want in zip(grads, expected_grads):
        if want is not None:
            assert torch.allclose(got, want, atol=1e-5)
    assert int(counts.sum()) == 15 * k  # every route counted, dropped or not
    routes = moe.deepspeed_moe.gate.route(x.reshape(-1, HIDDEN))
    assert bool(routes.kept.all()) is (not drop_tokens)  # capacity 0.5 drops some, dropless none


def test_capacity_is_deepspeeds_rule():
    assert _gating.capacity(16, 4, 1.0, 4) == 4
    assert _gating.capacity(10, 4, 1.0, 1) == 3  # ceil(2.5)
    assert _gating.capacity(10, 4, 1.0, 4) == 4  # at least min_capacity
    assert _gating.capacity(10, 4, 2 * 1.25, 1) == math.ceil(10 / 4 * 2.5)


def test_top1_keeps_an_experts_first_tokens_up_to_capacity():
    logits = torch.zeros(6, 3)
    logits[:, 1] = 5.0  # every token prefers expert 1
    logits[5, 2] = 10.0  # but the last
    routes = _gating.top1(logits, capacity_factor=1.0, min_capacity=1, use_rts=False)
    assert routes.capacity == 2
    assert routes.kept[:, 0].tolist() == [True, True, False, False, False, True]
    assert routes.exp_counts.tolist() == [0, 5, 1]
    probs = torch.softmax(logits, dim=1)
    assert torch.allclose(routes.weight[:, 0], probs.max(1).values * routes.kept[:, 0])
    mask = torch.nn.functional.one_hot(logits.argmax(1), 3).float()
    assert torch.isclose(routes.l_aux, (probs.mean(0) * mask.mean(0)).sum() * 3)


def test_top1_random_token_selection_keeps_capacity_tokens_of_the_expert():
    logits = torch.zeros(8, 2)
    logits[:, 0] = 3.0
    torch.manual_seed(1)
    routes = _gating.top1(logits, capacity_factor=1.0, min_capacity=1, use_rts=True)
    assert int(routes.kept.sum()) == 4  # capacity ceil(8 / 2) of the 8 tokens on expert 0
    used = torch.tensor([1, 1, 0, 0, 1, 1, 1, 1])
    routes = _gating.top1(logits, capacity_factor=4.0, min_capacity=1, used_token=used, use_rts=False)
    assert routes.kept[:, 0].tolist() == [bool(u) for u in used]  # unused tokens are not routed


def test_top2_places_first_choices_before_second_and_renormalizes():
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0], [0.0, 3.0, 2.0], [2.0, 3.0, 0.0]])
    routes = _gating.top2(logits, capacity_factor=0.5, min_capacity=1, second_expert_sampling=False)
    # capacity ceil(4 / 3 * 0.5 * 2) = 2; expert 1: first choices of tokens 2, 3 fill it, so
    # the second choices of tokens 0 and 1 are dropped; expert 0: token 0, 1 first choices
    assert routes.capacity == 2
    assert routes.expert.tolist() == [[0, 1], [0, 1], [1, 2], [1, 0]]
    assert routes.kept.tolist() == [[True, False], [True, False], [True, True], [True, False]]
    assert torch.allclose(routes.weight[0], torch.tensor([1.0, 0.0]))  # the kept route alone
    probs = torch.softmax(logits, dim=1)
    assert torch.allclose(routes.weight[2], probs[2, [1, 2]] / probs[2, [1, 2]].sum())
    assert routes.exp_counts.tolist() == [3, 4, 1]


def test_topk_drops_an_experts_least_probable_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0], [3.0, 2.5, 2.0, 0.0]])
    routes = _gating.topk(logits, 3, capacity_factor=0.25, min_capacity=1)
    assert routes.capacity == 1  # ceil(3 / 4 * 0.25 * 3)
    probs = torch.softmax(logits, dim=1)
    for e in range(4):  # each expert keeps only its most probable routed token
        routed = [(float(probs[s, e]), s) for s in range(3) if e in routes.expert[s].tolist()]
        kept = [s for s in range(3) for j in range(3) if routes.expert[s, j] == e and routes.kept[s, j]]
        assert kept == ([max(routed)[1]] if routed else [])


def test_deepspeed_dense_outputs_hold_the_routes():
    logits = torch.randn(12, 4)
    for gate in (
        lambda: top1gating(logits, 1.0, 1, use_rts=False),
        lambda: top2gating(logits, 1.0, 1, top2_2nd_expert_sampling=False),
        lambda: topkgating(logits, 3, 1.0, 1),
    ):
        l_aux, combine, dispatch, counts = gate()
        assert combine.dim() == 3 and combine.shape[:2] == (12, 4) and dispatch.dtype == torch.bool
        assert torch.equal(dispatch, combine > 0)
    gate = TopKGate(HIDDEN, 4, k=2, top2_2nd_expert_sampling=False)
    x = torch.randn(10, HIDDEN)
    _, combine, _, _ = gate(x)
    routes = gate.route(x)
    assert torch.allclose(combine.sum(dim=(1, 2)), routes.weight.sum(1))


def test_eval_uses_the_eval_capacity_factor():
    moe = _moe(k=1, capacity_factor=0.25, eval_capacity_factor=4.0)
    x = torch.randn(16, HIDDEN)
    assert not bool(moe.deepspeed_moe.gate.route(x).kept.all())
    moe.eval()
    assert bool(moe.deepspeed_moe.gate.route(x).kept.all())


def test_residual_moe_mixes_the_dense_mlp_by_a_learned_softmax():
    moe = _moe(k=1, use_residual=True, drop_tokens=False)
    x = torch.randn(4, HIDDEN)
    out, _, _ = moe(x)
    coef = torch.softmax(moe.coefficient(x), dim=-1)
    expected = _per_token(moe, x) * coef[:, :1] + moe.mlp(x) * coef[:, 1:]
    assert torch.allclose(out, expected, atol=1e-6)
    assert not any(is_moe_param(p) for p in moe.mlp.parameters())  # the residual MLP is dense


def test_names_and_markings_are_deepspeeds():
    moe = MoE(HIDDEN, _expert(), num_experts=4, ep_size=2, k=2)
    names = set(dict(moe.named_parameters()))
    assert "deepspeed_moe.gate.wg.weight" in names
    assert {n.split(".")[3] for n in names if n.startswith("deepspeed_moe.experts.")} == {"0", "1"}
    assert moe.num_local_experts == 2 and moe.expert_group_name == "ep_size_2"
    experts = list(moe.deepspeed_moe.experts.parameters())
    assert all(is_moe_param(p) and p.group_name == "ep_size_2" for p in experts)
    assert not is_moe_param(moe.deepspeed_moe.gate.wg.weight)
    with pytest.raises(RuntimeError, match="expert-parallel group"):
        moe(torch.randn(4, HIDDEN))  # split experts need initialize() first
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), moe)
    assert has_moe_layers(model) == (True, 4) and has_moe_layers(nn.Linear(2, 2)) == (False, 0)


def test_deepspeeds_retired_groups_initialize_names_its_replacement():
    from shardwise.utils import groups

    with pytest.raises(RuntimeError, match="pass ep_size to deepspeed.moe.layer.MoE"):
        groups.initialize(ep_size=2)


def test_optimizer_groups_put_experts_apart():
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), MoE(HIDDEN, _expert(), num_experts=2, ep_size=2))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "lr": 0.1})
    assert [g.get("moe", False) for g in groups] == [False, True]
    assert groups[1]["name"] == "ep_size_2" and groups[1]["lr"] == 0.1
    assert all(is_moe_param(p) for p in groups[1]["params"])
    groups = configure_moe_param_groups(list(model.parameters()))
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_experts": 6, "ep_size": 4}, "num_experts=6 is not divisible by ep_size=4"),
        ({"num_experts": 2, "k": 3}, "k=3: each token picks k of the 2 experts"),
        ({"noisy_gate_policy": "Gaussian"}, "unknown noisy_gate_policy='Gaussian'"),
    ],
)
def test_bad_arguments_say_what_to_change(kwargs, message):
    with pytest.raises((ValueError, NotImplementedError), match=message):
        MoE(HIDDEN, _expert(), **kwargs)


def test_noise_policies_run_in_training_only():
    for policy in ("Jitter", "RSample"):
        moe = _moe(k=1, noisy_gate_policy=policy, drop_tokens=False)
        x = torch.randn(32, HIDDEN)
        moe.eval()
        assert torch.equal(moe(x)[0], moe(x)[0])  # no noise in evaluation
        moe.train()
        torch.manual_seed(0)
        first = moe(x)[0]
        torch.manual_seed(1)
        assert not torch.equal(first, moe(x)[0])


def test_topk_position_policy_keeps_an_experts_first_tokens():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [4.0, 3.0, 2.0, 0.0], [3.0, 2.5, 2.0, 0.0]])
    routes = _gating.topk(logits, 3, capacity_factor=0.25, min_capacity=1, drop_policy="position")
    for e in range(3):  # experts 0-2 are chosen by every token: each keeps token 0 only
        kept = [s for s in range(3) for j in range(3) if routes.expert[s, j] == e and routes.kept[s, j]]
        assert kept == [0]
    with pytest.raises(ValueError, match="drop_policy='random': use 'probs' or 'position'"):
        _gating.topk(logits, 3, capacity_factor=1.0, min_capacity=1, drop_policy="random")


def test_deepspeeds_internal_sparse_routes_are_refused_by_name():
    logits = torch.randn(8, 4)
    for call in (
        lambda: top1gating(logits, 1.0, 1, sparse_routes=True),
        lambda: top2gating(logits, 1.0, 1, sparse_routes=True),
        lambda: topkgating(logits, 3, 1.0, 1, sparse_routes=True),
        lambda: TopKGate(HIDDEN, 4)(torch.randn(8, HIDDEN), sparse_routes=True),
    ):
        with pytest.raises(NotImplementedError, match="sparse_routes=True is DeepSpeed-internal"):
            call()


def test_a_rank_without_tokens_gets_an_empty_output_and_gradients():
    moe = _moe(k=2, drop_tokens=False)
    x = torch.zeros(0, HIDDEN, requires_grad=True)
    out, _, _ = moe(x)
    assert out.shape == (0, HIDDEN)
    out.sum().backward()
    assert x.grad.shape == (0, HIDDEN)
