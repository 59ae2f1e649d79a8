"""Fake quantization and masks: the grid has exactly 2**bits levels per group, gradients
pass straight through, and the bit schedule moves at DeepSpeed's MoQ steps."""

import pytest
import torch
import torch.nn.functional as F

from shardwise.compression._layers import ActivationQuantization, CompressedLinear, WeightQuantization, weight_bits
from shardwise.compression._quantizers import QuantSpec, fake_quantize, quantize_values, topk_mask_values


def _spread(groups, per_group, *, symmetric, seed=0):
    """Each group a shuffled, evenly spaced range with its own span (symmetric about 0 or
    not), so every level of the group's grid is hit."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for g in range(groups):
        low, high = (-1.0 - g, 1.0 + g) if symmetric else (-1.0 - g, 2.0 + 3 * g)
        rows.append(torch.linspace(low, high, per_group)[torch.randperm(per_group, generator=generator)])
    return torch.stack(rows).reshape(groups * per_group // 8, 8)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_each_group_takes_exactly_two_to_the_bits_levels(symmetric, bits):
    weight = _spread(groups=4, per_group=1024, symmetric=symmetric)
    quantized = quantize_values(weight, QuantSpec(bits=bits, groups=4, symmetric=symmetric))
    for group, original in zip(quantized.reshape(4, -1), weight.reshape(4, -1)):
        assert group.unique().numel() == 2**bits
        step = (original.max() - original.min()) / 2**bits  # the grid's step for this group
        # within a step, 1.5 for asymmetric grids (their zero point is rounded; the top is clamped)
        assert (group - original).abs().max() <= step * (1.0001 if symmetric else 1.5001)


def test_ternary_and_binary_grids():
    weight = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    assert quantize_values(weight, QuantSpec(bits=2, groups=2)).reshape(2, -1)[0].unique().numel() == 3
    assert quantize_values(weight, QuantSpec(bits=1)).unique().numel() == 2


def test_stochastic_rounding_stays_on_the_grid_and_is_unbiased():
    torch.manual_seed(0)
    value = torch.full((20000,), 0.3)
    value[0] = 1.0  # the group's maximum sets the scale: steps of 1/8 at 4 bits
    quantized = quantize_values(value, QuantSpec(bits=4, stochastic=True))
    assert set(quantized[1:].unique().tolist()) == {0.25, 0.375}
    assert abs(quantized[1:].mean().item() - 0.3) < 0.005


def test_gradients_pass_straight_through_to_weight_and_input():
    layer = CompressedLinear(8, 4)
    spec = WeightQuantization(
        start_bits=4, target_bits=4, period=1, offset=0, in_forward=True, grid=QuantSpec(bits=4, groups=4)
    )
    layer.enable_weight_quantization(spec)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).square().sum().backward()
    q = quantize_values(layer.weight.detach(), QuantSpec(bits=4, groups=4)).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    F.linear(x_ref, q, layer.bias.detach()).square().sum().backward()
    assert torch.equal(layer.weight.grad, q.grad) and torch.equal(x.grad, x_ref.grad)


def test_activations_are_quantized_per_token():
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2))
    quantized = fake_quantize(x, QuantSpec(bits=4, groups=6))
    assert all(row.unique().numel() <= 16 for row in quantized.reshape(6, -1))
    assert not torch.equal(quantized, quantize_values(x, QuantSpec(bits=4)))


@pytest.mark.parametrize("static", [False, True])
def test_the_layer_quantizes_its_input_per_token_or_in_a_running_range(static):
    layer = CompressedLinear(64, 4)
    layer.enable_activation_quantization(ActivationQuantization(bits=8, symmetric=False, static=static, offset=0))
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    if static:  # the first training batch sets the range
        expected = quantize_values(x, QuantSpec(bits=8, symmetric=False), (x.min(), x.max()))
        assert torch.equal(layer.x_min_max, torch.stack([x.min(), x.max()]))
    else:
        expected = quantize_values(x, QuantSpec(bits=8, groups=6, symmetric=False))
    assert torch.equal(out, F.linear(expected, layer.weight, layer.bias))


def test_topk_mask_keeps_the_dense_ratio_of_largest_scores():
    scores = torch.randn(10, 10, generator=torch.Generator().manual_seed(3))
    mask = topk_mask_values(scores, 0.37)
    assert mask.sum() == 37 and scores[mask.bool()].min() > scores[~mask.bool()].max()


def _spec(start, target, period, offset, in_forward=False):
    return WeightQuantization(
        start_bits=start,
        target_bits=target,
        period=period,
        offset=offset,
        in_forward=in_forward,
        grid=QuantSpec(bits=target),
    )


def test_bit_schedule_follows_deepspeeds_moq_steps():
    # offset 0: MoQ quantized in the first forward and after every step (run t+1 before
    # forward t); at each run reaching the period one bit goes and the period doubles
    assert [weight_bits(_spec(8, 4, 2, 0), t) for t in range(17)] == [8, 7, 7, 6, 6, 6, 6, 5] + [5] * 7 + [4, 4]
    # offset 3: the first run follows optimizer step 3, so forward 4 is the first quantized
    assert [weight_bits(_spec(8, 4, 1, 3), t) for t in range(12)] == [None] * 4 + [7, 6, 6, 5, 5, 5, 5, 4]
    assert [weight_bits(_spec(8, 4, 1, 2, in_forward=True), t) for t in range(4)] == [None, None, 4, 4]
