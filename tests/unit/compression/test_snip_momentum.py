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
    def __init__(self, conv=nn.Conv2d):
        super().__init__()
        self.conv = conv(2, 4, 3)
        self.fc = nn.Linear(6, 8)


_VIEW = " (the convolution viewed as out x kh*kw*in)"


@pytest.mark.parametrize(
    "shared, error, message",
    [
        ({"block_pattern": "4:4"}, ConfigError, "block_pattern '4:4': an 'N:M' pattern prunes N of every M"),
        ({"block_pattern": "channelx1"}, ConfigError, "'channelx1': the channel patterns of Intel Neural"),
        ({"block_pattern": "4by1"}, ConfigError, "block_pattern must be an 'NxM' block pattern"),
        ({"block_pattern": "1:4"}, ConfigError, "dense_ratio 0.25 prunes 75% of the weights, but block_pattern '1:4'"),
        ({"dense_ratio": 1.0}, ConfigError, "dense_ratio must be in (0, 1) for snip_momentum"),
        ({"schedule_offset": 0}, ConfigError, "schedule_offset must be >= 1 for snip_momentum"),
        ({"schedule_offset_end": 1}, ConfigError, "schedule_offset_end (1) must not be below"),
        ({"block_pattern": "8x1"}, ValueError, f"'8x1' blocks do not tile its 4x18 weight of 'conv'{_VIEW}"),
        ({"excluded_modules": ["conv"], "block_pattern": "4x4"}, ValueError, "'4x4' blocks do not tile its 8x6 weight"),
        (
            {"excluded_modules": ["conv"], "block_pattern": "2:4", "dense_ratio": 0.5},
            ValueError,
            "'2:4' groups of 4 do not tile the 6 input weights of its rows of 'fc'",
        ),
    ],
)
def test_bad_snip_momentum_settings_are_refused_by_name(shared, error, message):
    with pytest.raises(error, match=re.escape(message)):
        init_compression(_WithConv(), _snip(**shared))


def test_other_convolutions_are_refused_unless_excluded():
    with pytest.raises(ValueError, match=re.escape("snip_momentum of Conv1d layers ('conv') is not available")):
        init_compression(_WithConv(nn.Conv1d), _snip(block_pattern="2x1"))
    model = init_compression(_WithConv(nn.Conv1d), _snip(block_pattern="2x1", excluded_modules=["conv"]))
    assert type(model.conv) is nn.Conv1d and model.fc.sparse_pruning.method == "snip_momentum"


def test_snip_momentum_takes_no_groups():
    config = _snip()
    config["compression_training"]["sparse_pruning"]["different_groups"] = {
        "g": {"params": {"dense_ratio": 0.5}, "modules": ["fc1"]}
    }
    with pytest.raises(ConfigError, match="snip_momentum prunes every nn.Linear"):
        init_compression(TinyMLP(seed=1), config)


def test_snip_momentum_with_tensor_parallelism_is_refused():
    """Its scores average the gradients over every rank; tensor-parallel ranks hold other slices."""
    from shardwise.config import load_config
    from shardwise.runtime._training_features import build_training_features

    model = init_compression(TinyMLP(seed=1), _snip())
    config = load_config(
        {**_snip(), "train_micro_batch_size_per_gpu": 4, "tensor_parallel": {"autotp_size": 2}}, world_size=1
    )
    with pytest.raises(ConfigError, match=r"snip_momentum is not available with tensor_parallel.autotp_size 2"):
        build_training_features(config, model)


def test_zero2_scores_the_same_gradients_as_stage_0():
    scores = []
    for stage in (0, 2):
        model = init_compression(TinyMLP(seed=1), _snip())
        _train(_engine(model, {**_snip(), "zero_optimization": {"stage": stage}}), 2)
        scores.append(model.fc1.sparse_snip_scores)
    assert scores[0].abs().sum() > 0
    torch.testing.assert_close(scores[1], scores[0])


class _TinyCNN(nn.Module):
    """A 4 -> 8 channel 3x3 convolution (its 2-D view 8 x 36) and a 128 -> 4 linear head."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.fc = nn.Linear(128, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _images(step):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 4, 4, 4, generator=generator), torch.randint(0, 4, (8,), generator=generator)


def _train_cnn(model, steps, on_step=None):
    """The engine's order without the engine: backward, scores and masks, optimizer step."""
    scheduler = CompressionScheduler(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = _images(step)
        nn.functional.cross_entropy(model(x), y).backward()
        if on_step is not None:
            on_step(step)
        scheduler.step()
        optimizer.step()
        optimizer.zero_grad()


def _rows(tensor):
    """A conv weight as [out, kh * kw * in], written out here rather than taken from the library."""
    return tensor.permute(0, 2, 3, 1).reshape(tensor.shape[0], -1) if tensor.dim() == 4 else tensor


def test_conv2d_blocks_join_the_global_threshold_and_stay_masked_through_clean():
    config = _snip(excluded_modules=[], schedule_offset=2, schedule_offset_end=4, schedule_offset_stride=1)
    model = init_compression(_TinyCNN(), config)
    conv = model.conv
    grads, expected, seen = [], torch.zeros_like(conv.weight), []
    conv.weight.register_hook(grads.append)

    def on_step(step):
        nonlocal expected
        if step < 4:  # the scores of the steps before the last pruning step (4)
            expected = 0.9 * expected + (conv.weight.detach() * grads[-1]).abs()
        seen.append(sum(int((m.sparse_pruning_mask == 0).sum()) for m in (conv, model.fc)))

    _train_cnn(model, 5, on_step)
    torch.testing.assert_close(conv.sparse_snip_scores, expected)
    blocks = (8 * 36 + 4 * 128) // 4  # 4x1 blocks over both layers
    assert seen[1:] == [4 * math.floor((1 - 0.25 ** (k / 3)) * blocks + 1e-6) for k in (0, 1, 2, 3)]
    assert seen[-1] == 3 * blocks
    sums, alive = [], []
    for layer in (conv, model.fc):
        rows, mask = _rows(layer.sparse_snip_scores), _rows(layer.sparse_pruning_mask)
        per_block = mask.view(mask.shape[0] // 4, 4, -1).sum(dim=1)
        assert set(per_block.unique().tolist()) <= {0.0, 4.0}
        sums.append(rows.view(rows.shape[0] // 4, 4, -1).sum(dim=1).flatten())
        alive.append(per_block.flatten() > 0)
    sums, alive = torch.cat(sums), torch.cat(alive)
    assert 0 < int((~alive[:72]).sum()) < 72  # the convolution lost some blocks, not all
    assert sums[alive].min() >= sums[~alive].max()

    x, _ = _images(9)
    mask = conv.sparse_pruning_mask.clone()
    masked = nn.functional.conv2d(x, conv.weight * mask, conv.bias, padding=1)
    assert torch.equal(conv(x), masked)
    before = model(x)
    redundancy_clean(model, config)
    assert not hasattr(conv, "sparse_pruning_mask") and conv.sparse_pruning is None
    assert conv.weight.detach()[mask == 0].abs().sum() == 0
    torch.testing.assert_close(model(x), before)


@pytest.mark.parametrize("pattern, dense", [("2:4", 0.5), ("1:4", 0.75)])
def test_n_in_m_prunes_n_of_every_m_consecutive_input_weights(pattern, dense):
    pruned, group = (int(v) for v in pattern.split(":"))
    config = _snip(
        excluded_modules=[],
        block_pattern=pattern,
        dense_ratio=dense,
        schedule_offset=1,
        schedule_offset_end=2,
        schedule_offset_stride=1,
    )
    model = init_compression(_TinyCNN(), config)
    layers = (model.conv, model.fc)
    groups = (8 * 36 + 4 * 128) // group
    thinned = []
    _train_cnn(model, 3, lambda step: thinned.append(sum(int((m.sparse_pruning_mask == 0).sum()) for m in layers)))
    # 1 - dense ** (k / 2) of the weights at pruning step k, N of them per pruned group
    assert thinned[0] == 0 and thinned[1] == pruned * math.floor((1 - dense**0.5) * group / pruned * groups + 1e-6)
    for layer in layers:
        zeros = (_rows(layer.sparse_pruning_mask) == 0).view(layer.weight.shape[0], -1, group).sum(dim=-1)
        assert set(zeros.unique().tolist()) == {pruned}
    conv_zeros = (model.conv.sparse_pruning_mask == 0).permute(0, 2, 3, 1)  # groups: the 4 input channels
    assert set(conv_zeros.sum(dim=-1).unique().tolist()) == {pruned}


def _block_sums(layer):
    """Each 4x1 block's summed scores, and whether it is unpruned, flattened."""
    sums = layer.sparse_snip_scores.view(layer.out_features // 4, 4, -1).sum(dim=1).flatten()
    return sums, (layer.sparse_pruning_mask[::4] > 0).flatten()


def test_a_layer_the_global_threshold_would_empty_keeps_its_best_two_percent():
    """INC's max_sparsity_ratio_per_op (0.98): every fc2 block scores below every fc1 block,
    so the global threshold (half of the 256 blocks) would prune all 128 of fc2's; it keeps
    its 3 best (128 - int(0.98 * 128)) and fc1 loses its 3 lowest instead."""
    model = init_compression(TinyMLP(seed=1), _snip(dense_ratio=0.5, schedule_offset=1, schedule_offset_end=1))
    scheduler = CompressionScheduler(model)
    generator = torch.Generator().manual_seed(0)
    model.fc1.sparse_snip_scores.copy_(1 + torch.rand(model.fc1.weight.shape, generator=generator))
    model.fc2.sparse_snip_scores.copy_(0.01 * torch.rand(model.fc2.weight.shape, generator=generator))
    scheduler.advance(1)
    (sums1, alive1), (sums2, alive2) = _block_sums(model.fc1), _block_sums(model.fc2)
    assert int(alive2.sum()) == 3 and int((~alive1).sum()) == 3
    assert set(sums2[alive2].tolist()) == set(sums2.topk(3).values.tolist())
    assert set(sums1[~alive1].tolist()) == set((-sums1).topk(3).values.neg().tolist())


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_scores_read_the_clipped_gradient(optimizer, stage):
    """DeepSpeed's engine clipped the gradients before INC read them in the optimizer's step:
    the scores are those of one process that clips, then scores, then steps."""
    params = {"lr": 0.1} if optimizer == "SGD" else {"lr": 0.01, "weight_decay": 0.01}
    snip = _snip(schedule_offset=4, schedule_offset_end=4)
    config = {
        **snip,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": optimizer, "params": params},
        "gradient_clipping": 0.05,
        "zero_optimization": {"stage": stage},
    }
    model = init_compression(TinyMLP(seed=1), snip)
    engine, _, _, _ = shardwise.initialize(model=model, config=config)
    _train(engine, 3)

    reference = TinyMLP(seed=1)
    torch_optimizer = getattr(torch.optim, optimizer)(reference.parameters(), **params)
    expected = [torch.zeros_like(reference.fc1.weight), torch.zeros_like(reference.fc2.weight)]
    for tokens, targets in token_batches(num_steps=3, batch=4, seed=5):
        reference(tokens, targets).backward()
        assert torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05) > 0.1  # it clips
        for i, layer in enumerate((reference.fc1, reference.fc2)):
            expected[i] = 0.9 * expected[i] + (layer.weight.detach() * layer.weight.grad).abs()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    torch.testing.assert_close(model.fc1.sparse_snip_scores, expected[0])
    torch.testing.assert_close(model.fc2.sparse_snip_scores, expected[1])


def test_a_step_the_optimizer_skipped_adds_nothing_to_the_scores():
    """After an fp16 overflow the engine passes no clipping coefficient: the step's gradients
    (infinite or not) stay out of the scores, as INC's hook on the skipped optimizer step
    never ran; the layers still move to the next step."""
    from shardwise.compression.scheduler import CompressionFeature

    model = init_compression(TinyMLP(seed=1), _snip())
    feature = CompressionFeature(model)
    tokens, targets = token_batches(num_steps=1, batch=4, seed=5)[0]
    model(tokens, targets).backward()
    feature.before_model_step(0)
    feature.after_optimizer_step(0, 1.0)
    kept = model.fc1.sparse_snip_scores.clone()
    assert kept.abs().sum() > 0
    model.zero_grad()
    model(tokens, targets).backward()
    with torch.no_grad():
        model.fc1.weight.grad.fill_(float("inf"))  # what an overflow leaves
    feature.before_model_step(1)
    feature.after_optimizer_step(1, None)
    assert torch.equal(model.fc1.sparse_snip_scores, kept)
    assert feature.scheduler.training_steps == 2
