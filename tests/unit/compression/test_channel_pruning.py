"""Channel pruning of nn.Conv2d layers: masks, schedule, training, redundancy_clean, errors."""

import pytest
import torch
from torch import nn

import shardwise
from shardwise.compression.compress import init_compression, redundancy_clean
from shardwise.config import ConfigError


class TinyCNN(nn.Module):
    """conv1 -> bn1 -> relu -> conv2 -> relu -> flatten -> fc, on 3x4x4 images."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 6, 3, padding=1)
        self.fc = nn.Linear(6 * 16, 2)

    def forward(self, x):
        hidden = torch.relu(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(hidden, 1))


def _channels(method="l1", ratio=0.5, offset=0, modules=("conv1",), related=None):
    group = {"params": {"dense_ratio": ratio}, "modules": list(modules)}
    if related is not None:
        group["related_modules"] = related
    shared = {"enabled": True, "method": method, "schedule_offset": offset}
    return {
        "compression_training": {"channel_pruning": {"shared_parameters": shared, "different_groups": {"g": group}}}
    }


def _images(seed, n=4):
    return torch.randn(n, 3, 4, 4, generator=torch.Generator().manual_seed(seed))


def test_l1_mask_keeps_the_filters_with_the_largest_l1_norms():
    model = TinyCNN()
    with torch.no_grad():  # distinct norms: channel c's filter scaled by a permutation
        scale = torch.tensor([3.0, 8.0, 1.0, 6.0, 2.0, 7.0, 4.0, 5.0]).view(-1, 1, 1, 1)
        model.conv1.weight.copy_(model.conv1.weight.sign() * scale)
    init_compression(model, _channels(ratio=0.5))
    assert model.conv1.channel_pruning_mask.view(-1).tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert model.conv1.channel_pruning_mask.shape == (8, 1, 1, 1)  # DeepSpeed's buffer name and shape


def test_the_mask_zeroes_exactly_the_pruned_channels_from_the_offset_on():
    model = init_compression(TinyCNN(), _channels(offset=2))
    conv = model.conv1
    pruned = conv.channel_pruning_mask.view(-1) == 0
    x = _images(1)
    for step, masked in ((0, False), (1, False), (2, True), (5, True)):
        conv.set_step(step)
        out = conv(x)
        assert (out[:, pruned].abs().sum() == 0) == masked, step
        assert out[:, ~pruned].abs().amin(dim=(0, 2, 3)).gt(0).all()


def test_training_through_the_engine_keeps_pruned_channels_zero():
    model = init_compression(TinyCNN(), _channels(offset=1, related=[["bn1", "conv2"]]))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.2}},
        "compression_training": _channels(offset=1, related=[["bn1", "conv2"]])["compression_training"],
    }
    engine, _, _, _ = shardwise.initialize(model=model, config=config)
    pruned = model.conv1.channel_pruning_mask.view(-1) == 0
    seen = []
    model.bn1.register_forward_hook(lambda m, i, out: seen.append(out[:, pruned].abs().sum().item()))
    for step in range(3):
        loss = engine(_images(10 + step)).square().mean()
        engine.backward(loss)
        engine.step()
    assert seen[0] > 0 and seen[1:] == [0, 0]  # the BatchNorm's shift is masked too from the offset on
    assert model.conv1.weight.detach()[pruned].abs().sum() > 0  # the weights stay; the forward masks them


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_clean_removes_the_channels_and_computes_what_the_masked_model_computed(method):
    config = _channels(method=method, related=[["bn1", "conv2"]])
    model = init_compression(TinyCNN(seed=3), config)
    with torch.no_grad():
        model.bn1.bias.fill_(1.0)  # a shift the relu passes: an unmasked pruned channel would reach conv2
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(2):  # move bn1's shift and running statistics off their initial values
        model(_images(20 + step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    x = _images(30)
    before, params = model(x), sum(p.numel() for p in model.parameters())
    kept = int(model.conv1.channel_mask().sum())
    redundancy_clean(model, config)
    assert type(model.bn1) is nn.BatchNorm2d and model.bn1.num_features == kept == 4
    assert model.conv1.weight.shape[0] == kept and model.conv2.weight.shape[1] == kept
    removed = 4 * 27 + 4 + 4 * 2 + 6 * 4 * 9 + (8 if method == "topk" else 0)  # conv1, bn1, conv2, scores
    assert sum(p.numel() for p in model.parameters()) == params - removed
    torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)


def test_clean_cuts_a_related_linear_and_without_related_modules_zeroes_in_place():
    config = _channels(modules=["conv2"], related=[["fc"]])
    model = init_compression(TinyCNN(), config).eval()
    x = _images(4)
    before = model(x)
    redundancy_clean(model, config)
    assert model.fc.in_features == 3 * 16 and model.conv2.out_channels == 3
    torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)

    plain = _channels(modules=["conv2"])
    model = init_compression(TinyCNN(), plain).eval()
    before = model(x)
    redundancy_clean(model, plain)
    assert model.conv2.weight.shape == (6, 8, 3, 3) and (model.conv2.weight.flatten(1).abs().sum(1) == 0).sum() == 3
    torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)


def test_topk_scores_get_gradients_through_the_straight_through_mask():
    model = init_compression(TinyCNN(), _channels(method="topk", ratio=0.25))
    scores = model.conv1.channel_mask_scores
    assert scores.shape == (8, 1, 1, 1) and any(p is scores for p in model.parameters())
    out = model.conv1(_images(5))
    assert (out.abs().sum(dim=(0, 2, 3)) > 0).sum() == 2
    out.sum().backward()
    assert scores.grad is not None and scores.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "config, error, message",
    [
        (_channels(ratio=0.0), ConfigError, "dense_ratio must be in (0, 1]"),
        (_channels(ratio=1.5), ConfigError, "dense_ratio must be in (0, 1]"),
        (_channels(modules=["fc"]), ValueError, "matches no nn.Conv2d module of the model (it matches fc"),
        (_channels(modules=["conv1|bn1"]), ValueError, "matches 'bn1', a BatchNorm2d; channel pruning prunes"),
        (
            _channels(modules=["conv2"], related=[["bn1"]]),
            ValueError,
            "'bn1' cannot follow the pruned 'conv2': it is a BatchNorm2d of 8 channels, but the pruned "
            "convolution has 6",
        ),
        (_channels(modules=["conv2"], related=[["conv1"]]), ValueError, "a Conv2d of 3 channels"),
        (_channels(related=[["nothing"]]), ValueError, "related_modules: the pattern 'nothing' matches no"),
        (_channels(related=[["bn1|conv2"]]), ValueError, "a related_modules pattern matches 2 modules but"),
        (
            {
                "compression_training": {
                    "activation_quantization": {
                        "shared_parameters": {"enabled": True},
                        "different_groups": {"a": {"params": {"bits": 8}, "modules": ["*"]}},
                    }
                }
            },
            ValueError,
            "activation_quantization of nn.Conv2d layers is not available",
        ),
    ],
)
def test_bad_channel_pruning_input_gets_a_clear_error(config, error, message):
    with pytest.raises(error) as info:
        init_compression(TinyCNN(), config)
    assert message in str(info.value)


def test_a_grouped_convolution_is_masked_but_not_cut():
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2, padding=1, padding_mode="reflect"), nn.Conv2d(4, 2, 1))
    with pytest.raises(ValueError, match="'0': a grouped Conv2d \\(groups=2\\) cannot lose output channels"):
        init_compression(model, _channels(modules=["^0$"], related=[["^1$"]]))
    assert type(model[0]) is nn.Conv2d  # refused before anything was replaced
    config = _channels(modules=["^0$"])
    init_compression(model, config)
    x = torch.randn(1, 4, 5, 5, generator=torch.Generator().manual_seed(6))
    before = model(x)
    redundancy_clean(model, config)
    assert model[0].weight.shape == (4, 2, 3, 3)
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
