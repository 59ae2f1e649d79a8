"""The MoE layer on a CUDA GPU: grouped experts (``torch._grouped_mm``) against one module
call per expert, output and every gradient, fp32 and bf16, dropless and with drops; the
grouped path must run in bf16 on a Hopper GPU. Skipped without a GPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.moe import _grouped
from shardwise.moe._grouped import grouped_mm_works
from shardwise.moe.layer import MoE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN = 256


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, 512, bias=False)
        self.w2 = nn.Linear(512, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, 512, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _mlp():
    return nn.Sequential(nn.Linear(HIDDEN, 1024), nn.GELU(), nn.Linear(1024, HIDDEN))


def _grads(moe, x, grouped: bool):
    moe.deepspeed_moe.use_grouped_mm = grouped
    moe.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = moe(x)[0]
    out.float().pow(2).mean().backward()
    return out.detach().float(), x.grad.float(), {n: p.grad.float() for n, p in moe.named_parameters()}


@pytest.mark.parametrize("drop_tokens", [False, True], ids=["dropless", "capacity"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("make", [_mlp, SwiGLU], ids=["mlp", "swiglu"])
def test_grouped_experts_equal_one_call_per_expert_on_gpu(make, dtype, drop_tokens, monkeypatch):
    monkeypatch.setattr(_grouped, "FAST_ON", {("cuda", dtype)})  # fp32 too, though slower than the loop there
    assert grouped_mm_works(torch.device("cuda"), dtype)  # probed before counting the layer's calls
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    moe = MoE(HIDDEN, make(), num_experts=8, k=2, drop_tokens=drop_tokens, top2_2nd_expert_sampling=False)
    moe = moe.to("cuda", dtype)
    x = torch.randn(4, 512, HIDDEN, device="cuda", dtype=dtype)
    grouped, each = _grads(moe, x, True), _grads(moe, x, False)
    assert len(calls) == 2 + (make is SwiGLU)  # one grouped matmul per linear layer, forward
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(grouped[0], each[0], rtol=tol, atol=tol)
    torch.testing.assert_close(grouped[1], each[1], rtol=tol, atol=tol)
    for name in each[2]:
        scale = each[2][name].abs().max().clamp_min(1e-6)
        assert (grouped[2][name] - each[2][name]).abs().max() / scale < tol, name


def test_grouped_mm_runs_in_bf16_on_hopper(monkeypatch):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm's bf16 kernel needs sm90 or newer")
    assert grouped_mm_works(torch.device("cuda"), torch.bfloat16)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    moe = MoE(HIDDEN, _mlp(), num_experts=8, k=2).to("cuda", torch.bfloat16)
    moe(torch.randn(64, HIDDEN, device="cuda", dtype=torch.bfloat16))
    assert len(calls) == 2  # the default: grouped in bf16 on a GPU
    moe.float()(torch.randn(64, HIDDEN, device="cuda"))
    assert len(calls) == 2  # fp32 runs one call per expert
