"""Grouped experts (one ``torch._grouped_mm`` per linear layer) against one module call per
expert: outputs and every gradient, which experts qualify, and that the MoE layer takes
the grouped path where they do."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.moe import _grouped
from shardwise.moe._dispatch import run_each
from shardwise.moe._grouped import GroupedExperts
from shardwise.moe.layer import MoE

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")

HIDDEN = 16


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, 32, bias=False)
        self.w2 = nn.Linear(32, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, 32, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class FusedGateUp(nn.Module):
    def __init__(self, dim=-1):
        super().__init__()
        self.up = nn.Linear(HIDDEN, 64)
        self.down = nn.Linear(32, HIDDEN)
        self.dim = dim

    def forward(self, x):
        gate, up = self.up(x).chunk(2, dim=self.dim)
        return self.down(F.gelu(gate) * up) * 0.5


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else x


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.scale = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x):
        return self.fc(x) * self.scale


def _mlp():
    return nn.Sequential(nn.Linear(HIDDEN, 48), nn.GELU(), nn.Linear(48, HIDDEN))


def _experts(make, n=4):
    experts = []
    for i in range(n):
        torch.manual_seed(i)
        experts.append(make())
    return experts


def _run(fn, experts, rows, counts):
    rows = rows.detach().requires_grad_()
    for expert in experts:
        expert.zero_grad(set_to_none=True)
    out = fn(rows, counts)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [p.grad.clone() for expert in experts for p in expert.parameters()]
    return out.detach(), rows.grad, grads


@pytest.mark.parametrize("make", [_mlp, SwiGLU, FusedGateUp], ids=["mlp", "swiglu", "fused-gate-up"])
@pytest.mark.parametrize("counts", [[5, 0, 9, 2], [0, 0, 16, 0], [1, 1, 1, 13]])
def test_grouped_equals_one_call_per_expert(make, counts):
    experts = _experts(make)
    plan = GroupedExperts.plan(experts)
    assert plan is not None
    rows = torch.randn(sum(counts), HIDDEN)
    assert plan.usable(rows)
    got = _run(plan, experts, rows, counts)
    expected = _run(lambda r, c: run_each(experts, r, c), experts, rows, counts)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)
    for g, e in zip(got[2], expected[2], strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "experts",
    [
        _experts(Branchy),  # control flow does not trace
        _experts(Scaled),  # a parameter used outside an nn.Linear
        _experts(lambda: FusedGateUp(dim=0)),  # a split across rows mixes experts
        [_mlp(), nn.Sequential(nn.Linear(HIDDEN, 48), nn.GELU("tanh"), nn.Linear(48, HIDDEN))],
        [_mlp(), nn.Sequential(nn.Linear(HIDDEN, 48), nn.ReLU(), nn.Linear(48, HIDDEN))],
        [_mlp(), nn.Sequential(nn.Linear(HIDDEN, 40), nn.GELU(), nn.Linear(40, HIDDEN))],
        [nn.Sequential(nn.Linear(HIDDEN, 48), nn.LayerNorm(48), nn.Linear(48, HIDDEN))],  # LayerNorm has weights
    ],
    ids=["control-flow", "parameter-outside-linear", "split-dim-0", "gelu-tanh", "other-op", "other-width", "norm"],
)
def test_experts_that_do_not_qualify_run_one_by_one(experts):
    assert GroupedExperts.plan(experts) is None


def test_hooks_dtype_and_alignment_keep_the_per_expert_path():
    experts = _experts(_mlp)
    plan = GroupedExperts.plan(experts)
    rows = torch.randn(8, HIDDEN)
    assert plan.usable(rows)
    handle = experts[2][1].register_forward_hook(lambda *args: None)
    assert not plan.usable(rows)
    handle.remove()
    assert plan.usable(rows)
    assert not plan.usable(rows.double())
    assert not plan.usable(rows[:0])
    odd = _experts(lambda: nn.Sequential(nn.Linear(HIDDEN, 6), nn.GELU(), nn.Linear(6, HIDDEN)))
    assert not GroupedExperts.plan(odd).usable(rows)  # 6 fp32 columns = 24 bytes, not a multiple of 16


def test_moe_layer_takes_the_grouped_path(monkeypatch):
    monkeypatch.setattr(_grouped, "FAST_ON", {("cpu", torch.float32)})
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    moe = MoE(HIDDEN, SwiGLU(), num_experts=4, k=2, drop_tokens=False, top2_2nd_expert_sampling=False)
    x = torch.randn(3, 10, HIDDEN)
    grouped = moe(x)[0]
    assert len(calls) == 3  # w1, w3, w2 once each for all four experts
    moe.deepspeed_moe.use_grouped_mm = False
    torch.testing.assert_close(grouped, moe(x)[0], rtol=1e-5, atol=1e-5)
    assert len(calls) == 3


def test_the_cpu_and_fp32_run_one_call_per_expert(monkeypatch):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    moe = MoE(HIDDEN, SwiGLU(), num_experts=4, k=2, drop_tokens=False)
    moe(torch.randn(3, 10, HIDDEN))
    assert not calls  # torch's CPU _grouped_mm is a slower loop (see [Note: grouped experts])


def test_a_failing_probe_keeps_the_per_expert_path(monkeypatch):
    monkeypatch.setattr(_grouped, "FAST_ON", {("cpu", torch.float32)})
    monkeypatch.setattr(_grouped, "_PROBED", {})

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this dtype")

    monkeypatch.setattr(torch, "_grouped_mm", broken)
    experts = _experts(_mlp)
    rows = torch.randn(8, HIDDEN)
    assert not GroupedExperts.plan(experts).usable(rows)
    moe = MoE(HIDDEN, _mlp(), num_experts=2, drop_tokens=False)
    assert moe(rows)[0].shape == rows.shape
