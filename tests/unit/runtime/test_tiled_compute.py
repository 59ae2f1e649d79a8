"""ALST's tiled compute (``TiledMLP``, ``TiledFusedLogitsLoss``, ``sequence_tiled_compute``):
the same outputs and gradients as the untiled computation, tiles that do not divide the
sequence, only the inputs kept for backward, and a loss scaled after the tiled loss scales
every gradient (DeepSpeed's misses the parameters')."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

B, S, H, V = 2, 10, 8, 24


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gate, self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _grads(module, x, run):
    module.zero_grad()
    x = x.detach().requires_grad_()
    out = run(module, x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in module.parameters()]


def _close(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-6)
    for g, e in zip(a[2], b[2], strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shards", [1, 3, 4, 10])
def test_tiled_mlp_equals_the_mlp(shards):
    mlp, x = MLP(), torch.randn(B, S, H)
    tiled = _grads(mlp, x, lambda m, x: TiledMLP.apply(MLP.forward, m, x, shards, list(m.parameters())))
    _close(tiled, _grads(mlp, x, lambda m, x: m(x)))


def _saved_numel(run):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        run()
    return sum(saved)


def test_tiled_mlp_keeps_only_its_input_for_backward():
    mlp, x = MLP(), torch.randn(B, S, H, requires_grad=True)
    tiled = _saved_numel(lambda: TiledMLP.apply(MLP.forward, mlp, x, 4, None))
    plain = _saved_numel(lambda: mlp(x))
    assert tiled == B * S * H  # x itself
    assert plain >= 3 * B * S * 4 * H  # gate, up and their product, [b, s, 4h] each


def _loss_fn(head, x, y):
    return F.cross_entropy(head(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")


def test_tiled_logits_loss_equals_the_loss_and_scales_every_gradient():
    head = nn.Linear(H, V)
    x = torch.randn(B, S, H, requires_grad=True)
    y = torch.randint(0, V, (B, S))
    y[0, :3] = -100
    tokens = int((y != -100).sum())
    loss = TiledFusedLogitsLoss.apply(_loss_fn, head, x, y, None, 3, [head.weight], "sum") / tokens
    (3.0 * loss).backward()  # a scale applied after the tiled loss (accumulation, loss scaling)
    got = (loss.detach(), x.grad.clone(), head.weight.grad.clone())
    head.zero_grad()
    x.grad = None
    reference = _loss_fn(head, x, y) / tokens
    (3.0 * reference).backward()
    torch.testing.assert_close(got[0], reference.detach())
    torch.testing.assert_close(got[1], x.grad)
    torch.testing.assert_close(got[2], head.weight.grad)


def test_tiled_logits_loss_runs_the_head_once_per_tile_and_reaches_every_parameter():
    """The gradients come from forward (no second head per tile in backward), for the head's
    weight and bias and a parameter ``fn`` reaches outside the module."""
    head, scale = nn.Linear(H, V), nn.Parameter(torch.tensor(1.5))
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))

    def fn(module, x, y):
        return _loss_fn(module, x * scale, y)

    x, y = torch.randn(B, S, H, requires_grad=True), torch.randint(0, V, (B, S))
    (2.0 * TiledFusedLogitsLoss.apply(fn, head, x, y, None, 3, [head.weight], "mean")).backward()
    assert len(calls) == 3
    got = [t.grad.clone() for t in (x, head.weight, head.bias, scale)]
    for t in (x, head.weight, head.bias, scale):
        t.grad = None
    tiles = [slice(0, 4), slice(4, 8), slice(8, 10)]
    (2.0 * sum(fn(head, x[:, t], y[:, t]) for t in tiles) / 3).backward()
    for grad, t in zip(got, (x, head.weight, head.bias, scale)):
        torch.testing.assert_close(grad, t.grad)


def test_tiled_logits_loss_recomputes_under_zero3():
    """A ZeRO-3 parameter (``ds_shape``) is whole only inside its forward: the loss is
    recomputed in backward instead, with the same gradients."""
    head = nn.Linear(H, V)
    head.weight.ds_shape = head.weight.shape
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    x, y = torch.randn(B, S, H, requires_grad=True), torch.randint(0, V, (B, S))
    TiledFusedLogitsLoss.apply(_loss_fn, head, x, y, None, 2, [head.weight], "sum").backward()
    assert len(calls) == 4
    got = (x.grad.clone(), head.weight.grad.clone())
    x.grad, head.weight.grad = None, None
    _loss_fn(head, x, y).backward()
    torch.testing.assert_close(got[0], x.grad)
    torch.testing.assert_close(got[1], head.weight.grad)


def test_tiled_logits_loss_mean_averages_the_tiles():
    head = nn.Linear(H, V)
    x, y = torch.randn(B, S, H), torch.randint(0, V, (B, S))
    tiles = [slice(0, 5), slice(5, 10)]
    loss = TiledFusedLogitsLoss.apply(_loss_fn, head, x, y, None, 2, None, "mean")
    torch.testing.assert_close(loss, sum(_loss_fn(head, x[:, t], y[:, t]) for t in tiles) / 2)


@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
def test_sequence_tiled_compute_equals_the_function(reduction):
    mlp, x = MLP(), torch.randn(B, S, H)

    def fn(hidden, scale):
        return mlp(hidden) * scale

    def reduce(out):
        return out if reduction is None else (out.mean() if reduction == "mean" else out.sum())

    def tiled(m, x):
        out = sequence_tiled_compute(fn, S, 4, {"hidden": x}, {"scale": 2.0}, "hidden", None, 1, reduction)
        return out.reshape(1) if reduction else out

    _close(_grads(mlp, x, tiled), _grads(mlp, x, lambda m, x: reduce(fn(x, 2.0)).reshape(-1 if reduction else x.shape)))


def test_sequence_tiled_compute_stacks_per_tile_outputs():
    mlp, x = MLP(), torch.randn(B, S, H)

    def fn(hidden):
        return mlp(hidden).pow(2).sum()

    def tiled(m, x):
        return sequence_tiled_compute(fn, S, 2, {"hidden": x}, {}, "hidden", None, 0, "mean").reshape(1)

    def plain(m, x):
        return ((fn(x[:, :5]) + fn(x[:, 5:])) / 2).reshape(1)

    _close(_grads(mlp, x, tiled), _grads(mlp, x, plain))


def test_an_unknown_reduction_is_refused():
    head, x, y = nn.Linear(H, V), torch.randn(B, S, H), torch.randint(0, V, (B, S))
    with pytest.raises(ValueError, match="output_reduction must be 'mean' or 'sum'"):
        TiledFusedLogitsLoss.apply(_loss_fn, head, x, y, None, 2, None, "max")
    with pytest.raises(ValueError, match="output_reduction must be None, 'mean' or 'sum'"):
        sequence_tiled_compute(lambda hidden: hidden, S, 2, {"hidden": x}, {}, "hidden", None, 1, "max")


@pytest.mark.parametrize("saved_after", [False, True], ids=["mlp-last", "output-saved-after"])
def test_tiled_mlp_in_a_checkpointed_block_skips_only_an_unread_recomputation(saved_after):
    """In a checkpoint's recomputation that ends with TiledMLP's saved input (a Llama layer),
    the MLP's output is never read, so it is not computed (see [Note: tiled compute under
    checkpointing]); when a later op saves it, it is. The gradients equal the plain block's."""
    from torch.utils.checkpoint import checkpoint

    mlp, norm, scale = MLP(), nn.LayerNorm(H), nn.Parameter(torch.tensor(1.5))
    rows = []

    def fn(module, x):
        rows.append(x.shape[1])
        return MLP.forward(module, x)

    def block(x, tiled):
        h = norm(x)
        out = TiledMLP.apply(fn, mlp, h, 2, None) if tiled else mlp(h)
        return x + (out * scale if saved_after else out)

    def grads(tiled):
        x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out = checkpoint(block, x, tiled, use_reentrant=False)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        params = [mlp, norm]
        found = [x.grad, scale.grad] + [p.grad for m in params for p in m.parameters()]
        result = [g.clone() for g in found if g is not None]
        for p in [x, scale] + [p for m in params for p in m.parameters()]:
            p.grad = None
        return result

    tiled = grads(True)
    assert sum(rows) == S * (3 if saved_after else 2), rows  # forward, [recomputation,] backward
    for got, expected in zip(tiled, grads(False), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
