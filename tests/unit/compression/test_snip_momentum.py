"""Sparse pruning's snip_momentum method: scores, block pattern, schedule, engine, checkpoints."""

import math
import re

import pytest
import torch
from torch import nn

import shardwise
from shardwise.compression.compress import init_compression, redundancy_clean
from shardwise.compression.scheduler import CompressionScheduler
from shardwise.config import ConfigError
from shardwise.testing.models import TinyMLP, token_batches


def _snip(**shared):
    settings = {
        "enabled": True,
        "method": "snip_momentum",
        "dense_ratio": 0.25,
        "block_pattern": "4x1",
        "schedule_offset": 2,
        "schedule_offset_end": 6,
        "schedule_offset_stride": 2,
        "excluded_modules": ["head"],
    }
    return {"compression_training": {"sparse_pruning": {"shared_parameters": {**settings, **shared}}}}


def _engine(model, config):
    config = {
        **config,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 0.0,
    }
    engine, _, _, _ = shardwise.initialize(model=model, config=config)
    return engine


def _train(engine, steps, seed=5):
    for tokens, targets in token_batches(num_steps=steps, batch=4, seed=seed):
        engine.backward(engine(tokens, targets))
        engine.step()


def _zeros(model):
    return sum(int((m.sparse_pruning_mask == 0).sum()) for m in (model.fc1, model.fc2))


def test_the_score_is_weight_times_gradient_with_momentum():
    model = init_compression(TinyMLP(seed=1), _snip())
    scheduler = CompressionScheduler(model)
    fc1 = model.fc1
    grads = [torch.randn_like(fc1.weight) for _ in range(2)]
    for grad in grads:  # two micro-batches per step: their gradients add up
        (fc1.weight * grad / 2).sum().backward()
        (fc1.weight * grad / 2).sum().backward()
        scheduler.step()
    expected = 0.9 * (fc1.weight * grads[0]).abs() + (fc1.weight * grads[1]).abs()
    torch.testing.assert_close(fc1.sparse_snip_scores, expected.detach())


def test_the_schedule_reaches_dense_ratio_in_whole_blocks_and_pruned_weights_stay_zero(tmp_path):
    model = init_compression(TinyMLP(seed=1), _snip())
    numel = model.fc1.weight.numel() + model.fc2.weight.numel()
    engine = _engine(model, _snip())
    _train(engine, 1)
    assert _zeros(model) == 0  # the first pruning step is 2
    seen = []
    for _ in range(3):  # pruning steps 2, 4, 6: kept fraction 0.25 ** (k / 3), in 4x1 blocks
        _train(engine, 2)
        seen.append(_zeros(model))
    blocks = numel // 4
    assert seen == [4 * math.floor((1 - 0.25 ** (k / 3)) * blocks + 1e-6) for k in (1, 2, 3)]
    assert seen[-1] == 0.75 * numel
    kept, pruned = [], []  # the lowest block scores (summed over both layers) were pruned
    for layer in (model.fc1, model.fc2):
        sums = layer.sparse_snip_scores.view(layer.out_features // 4, 4, -1).sum(dim=1)
        alive = layer.sparse_pruning_mask[::4] > 0
        kept.append(sums[alive])
        pruned.append(sums[~alive])
    assert torch.cat(kept).min() >= torch.cat(pruned).max()
    for layer in (model.fc1, model.fc2):
        per_block = layer.sparse_pruning_mask.view(layer.out_features // 4, 4, -1).sum(dim=1)
        assert set(per_block.unique().tolist()) <= {0.0, 4.0}
    masks = [m.sparse_pruning_mask.clone() for m in (model.fc1, model.fc2)]
    pruned_before = model.fc1.weight.detach()[masks[0] == 0].clone()
    _train(engine, 2, seed=8)  # past schedule_offset_end: masks fixed, pruned weights get no gradient
    assert torch.equal(model.fc1.sparse_pruning_mask, masks[0])
    assert torch.equal(model.fc1.weight.detach()[masks[0] == 0], pruned_before)
    assert model.fc1.compressed_weight()[0][masks[0] == 0].abs().sum() == 0
    engine.save_checkpoint(str(tmp_path))

    fresh = init_compression(TinyMLP(seed=7), _snip())
    resumed = _engine(fresh, _snip())
    resumed.load_checkpoint(str(tmp_path))
    for a, b in ((fresh.fc1, model.fc1), (fresh.fc2, model.fc2)):
        assert torch.equal(a.sparse_pruning_mask, b.sparse_pruning_mask)
        assert torch.equal(a.sparse_snip_scores, b.sparse_snip_scores)
    tokens, targets = token_batches(num_steps=1, batch=4, seed=9)[0]
    assert torch.equal(resumed(tokens, targets), engine(tokens, targets))

    expected = engine(tokens, targets)
    redundancy_clean(model, _snip())
    assert not hasattr(model.fc1, "sparse_pruning_mask") and model.fc1.sparse_pruning is None
    assert (model.fc1.weight == 0).sum() >= (masks[0] == 0).sum()
    torch.testing.assert_close(model(tokens, targets), expected)


class _WithConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.fc = nn.Linear(6, 8)


@pytest.mark.parametrize(
    "shared, error, message",
    [
        ({"block_pattern": "2:4"}, ConfigError, "'2:4': the N:M and channel patterns"),
        ({"block_pattern": "channelx1"}, ConfigError, "'channelx1': the N:M and channel patterns"),
        ({"block_pattern": "4by1"}, ConfigError, "block_pattern must be an 'NxM' block pattern"),
        ({"dense_ratio": 1.0}, ConfigError, "dense_ratio must be in (0, 1) for snip_momentum"),
        ({"schedule_offset": 0}, ConfigError, "schedule_offset must be >= 1 for snip_momentum"),
        ({"schedule_offset_end": 1}, ConfigError, "schedule_offset_end (1) must not be below"),
        ({"excluded_modules": []}, ValueError, "snip_momentum of nn.Conv2d layers ('conv')"),
        ({"excluded_modules": ["conv"], "block_pattern": "4x4"}, ValueError, "'4x4' does not tile the 8x6 weight"),
    ],
)
def test_bad_snip_momentum_settings_are_refused_by_name(shared, error, message):
    with pytest.raises(error, match=re.escape(message)):
        init_compression(_WithConv(), _snip(**shared))


def test_snip_momentum_takes_no_groups():
    config = _snip()
    config["compression_training"]["sparse_pruning"]["different_groups"] = {
        "g": {"params": {"dense_ratio": 0.5}, "modules": ["fc1"]}
    }
    with pytest.raises(ConfigError, match="snip_momentum prunes every nn.Linear"):
        init_compression(TinyMLP(seed=1), config)


def test_zero2_scores_the_same_gradients_as_stage_0():
    scores = []
    for stage in (0, 2):
        model = init_compression(TinyMLP(seed=1), _snip())
        _train(_engine(model, {**_snip(), "zero_optimization": {"stage": stage}}), 2)
        scores.append(model.fc1.sparse_snip_scores)
    assert scores[0].abs().sum() > 0
    torch.testing.assert_close(scores[1], scores[0])
