"""The split backward of zero-bubble schedules ([Note: split backward]): the input half
gives the input gradients and touches no parameter; the weight half accumulates the
parameter gradients; together they equal one whole backward, matmul for matmul (nothing
is computed twice), in cases where parameters meet the input's path once, several times,
one junction below another, and not at all."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.pipe._split_backward import backward_input


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TwiceInParallel(nn.Module):
    """One linear used on two branches: two junctions side by side."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + self.lin(x * 2)


class TwiceInSeries(nn.Module):
    """One linear applied twice in a row: one junction below the other."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class WithBranchWithoutInput(nn.Module):
    """A second output from a parameter alone (no path to the input)."""

    def __init__(self):
        super().__init__()
        self.lin, self.bias_out = nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x):
        return self.lin(x), self.bias_out * 3


def _whole(module, x, grads):
    x = x.detach().clone().requires_grad_()
    outs = module(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    with CountMatmuls() as counter:
        torch.autograd.backward(outs, grads)
    return x.grad, [p.grad for p in module.parameters()], counter.count


@pytest.mark.parametrize("make", [Mlp, TwiceInParallel, TwiceInSeries, WithBranchWithoutInput])
def test_the_two_halves_equal_one_whole_backward(make):
    torch.manual_seed(0)
    module = make()
    reference = copy.deepcopy(module)
    x = torch.randn(4, 8, requires_grad=True)
    probe = module(x)
    grads = [torch.randn_like(t) for t in (probe if isinstance(probe, tuple) else (probe,))]
    ref_input, ref_params, whole = _whole(reference, x, grads)

    outs = module(x)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    params = list(module.parameters())
    with CountMatmuls() as first:
        (input_grad,), half = backward_input(outs, grads, [x], params)
    assert all(p.grad is None for p in params), "the input half accumulated parameter gradients"
    assert x.grad is None  # returned, not accumulated
    torch.testing.assert_close(input_grad, ref_input, rtol=0, atol=0)
    with CountMatmuls() as second:
        half.run()
    for p, ref in zip(params, ref_params):
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)
    if make is not TwiceInSeries:  # there the upper junction's input side leads to the lower one
        assert first.count + second.count == whole, (first.count, second.count, whole)
    assert first.count > 0 and second.count > 0


def test_a_scalar_loss_splits_and_accumulates_onto_earlier_gradients():
    torch.manual_seed(0)
    module = Mlp()
    x = torch.randn(4, 8, requires_grad=True)
    labels = torch.randint(0, 8, (4,))
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    (input_grad,), half = backward_input([F.cross_entropy(module(x), labels)], [None], [x], list(module.parameters()))
    half.run()
    reference = copy.deepcopy(module)
    reference.zero_grad(set_to_none=True)
    x2 = x.detach().clone().requires_grad_()
    F.cross_entropy(reference(x2), labels).backward()
    torch.testing.assert_close(input_grad, x2.grad)
    for p, ref in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, ref.grad + 1)


def test_an_input_without_gradient_leaves_the_whole_backward_to_the_weight_half():
    torch.manual_seed(0)
    embedding, block = nn.Embedding(10, 8), Mlp()
    tokens = torch.randint(0, 10, (4,))
    out = block(embedding(tokens))
    params = list(embedding.parameters()) + list(block.parameters())
    (input_grad,), half = backward_input([out], [torch.ones(4, 8)], [tokens], params)
    assert input_grad is None and all(p.grad is None for p in params)
    fired = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    half.run()
    assert len(fired) == len(params)  # the ZeRO strategies' hooks fire in the weight half
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
