"""Kept attention outputs ([Note: kept attention outputs]): under non-reentrant activation
checkpointing the recompute takes the forward's attention output instead of running the kernel
again, gradients equal an unchecked run, several forwards in flight each get their own output,
and nothing stays alive once the graphs are gone."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.sequence import _kept_attention

HEADS, KV_HEADS, DIM, SEQ = 4, 2, 8, 12


class _Attention(nn.Module):
    is_causal = True

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(16, HEADS * DIM)
        self.kv = nn.Linear(16, 2 * KV_HEADS * DIM)


def _heads(x, heads):
    return x.view(x.shape[0], SEQ, heads, DIM).transpose(1, 2)


def _layer(attention, keeper, x):
    q = _heads(attention.q(x), HEADS)
    k, v = (_heads(t, KV_HEADS) for t in attention.kv(x).chunk(2, dim=-1))
    if keeper is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    else:
        out = _kept_attention.attention(keeper, attention, q, k, v, {"scaling": None})
    return out.reshape(x.shape[0], SEQ, HEADS * DIM).square().sum()


def _counting(monkeypatch):
    calls = []
    flash = _kept_attention._FLASH

    def counted(*args, **kwargs):
        calls.append(1)
        return flash(*args, **kwargs)

    monkeypatch.setattr(_kept_attention, "_FLASH", counted)
    return calls


def test_the_recompute_takes_the_kept_output_and_gradients_are_unchanged(monkeypatch):
    calls = _counting(monkeypatch)
    attention, keeper = _Attention(), _kept_attention.KeptAttention()
    inputs = [torch.randn(2, SEQ, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    expected = []
    for x in inputs:
        attention.zero_grad()
        _layer(attention, None, x.requires_grad_()).backward()
        expected.append((x.grad.clone(), [p.grad.clone() for p in attention.parameters()]))
        x.grad = None

    # two checkpointed forwards in flight, their backwards in reverse order
    losses = [checkpoint(_layer, attention, keeper, x, use_reentrant=False) for x in inputs]
    assert len(calls) == 2 and keeper.live(attention) == 2
    for x, loss, (grad_x, grad_params) in reversed(list(zip(inputs, losses, expected))):
        attention.zero_grad()
        loss.backward()
        torch.testing.assert_close(x.grad, grad_x, rtol=1e-5, atol=1e-6)
        for got, want in zip([p.grad for p in attention.parameters()], grad_params):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(calls) == 2  # the recomputes ran no kernel
    del losses, loss
    assert keeper.live(attention) == 0  # kept tensors die with their graphs


def test_a_recompute_with_other_inputs_runs_the_kernel(monkeypatch):
    calls = _counting(monkeypatch)
    attention, keeper = _Attention(), _kept_attention.KeptAttention()
    x = torch.randn(2, SEQ, 16, requires_grad=True)
    loss = checkpoint(_layer, attention, keeper, x, use_reentrant=False)
    with torch.no_grad():
        attention.q.weight.add_(0.01)  # the recompute sees other query heads than the forward did
    loss.backward()
    assert len(calls) == 2


def test_sdpa_calls_it_cannot_compute_run_the_original():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attention = _Attention().train()
    q, k, v = torch.randn(1, HEADS, SEQ, DIM), torch.randn(1, KV_HEADS, SEQ, DIM), torch.randn(1, KV_HEADS, SEQ, DIM)
    applies = _kept_attention.applies
    assert applies(sdpa_attention_forward, attention, q, k, v, {"dropout": 0.0})
    assert not applies(sdpa_attention_forward, attention, q, k, v, {"dropout": 0.1})
    assert not applies(sdpa_attention_forward, attention, q, k, v, {"position_bias": torch.zeros(1)})
    assert not applies(lambda *a, **k: None, attention, q, k, v, {})
    assert not applies(sdpa_attention_forward, attention.eval(), q, k, v, {})
    with torch.no_grad():
        assert not applies(sdpa_attention_forward, attention.train(), q, k, v, {})
