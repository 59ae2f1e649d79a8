"""Weight quantization and sparse pruning (l1, topk) of nn.Conv2d layers."""

import pytest
import torch
from torch import nn

import shardwise
from shardwise.compression.compress import init_compression, redundancy_clean


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1), nn.Flatten(), nn.Linear(32, 2))


def _config(*, bits=None, groups=4, method=None, ratio=0.25, offset=0):
    section = {}
    if bits is not None:
        section["weight_quantization"] = {
            "shared_parameters": {"enabled": True, "quantize_groups": groups, "schedule_offset": offset},
            "different_groups": {"w": {"params": {"start_bits": bits, "target_bits": bits}, "modules": ["^0$"]}},
        }
    if method is not None:
        section["sparse_pruning"] = {
            "shared_parameters": {"enabled": True, "method": method, "schedule_offset": offset},
            "different_groups": {"s": {"params": {"dense_ratio": ratio}, "modules": ["^0$", "^2$"]}},
        }
    return {"compression_training": section}


def _images(seed):
    return torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(seed))


def test_weight_quantization_puts_each_filter_on_its_own_grid_and_clean_writes_it():
    config = _config(bits=3)
    model = init_compression(_model(), config)
    conv = model[0]
    assert conv.current_bits() == 3
    weight = conv.compressed_weight()[0].detach()
    assert not torch.equal(weight, conv.weight)
    for row in weight.flatten(1):  # quantize_groups = out_channels: 2**3 levels per filter
        assert row.unique().numel() <= 8
    x = _images(1)
    before = model(x)
    redundancy_clean(model, config)
    assert conv.weight_quantization is None and torch.equal(conv.weight.detach(), weight)
    torch.testing.assert_close(model(x), before)


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_sparse_pruning_masks_filter_elements_through_training_and_clean(method):
    config = _config(method=method, offset=1)
    model = init_compression(_model(), config)
    conv = model[0]
    if method == "l1":  # the largest magnitudes are kept
        kept = conv.weight.detach().abs()[conv.sparse_mask() > 0]
        assert kept.numel() == 27 and kept.min() >= conv.weight.detach().abs()[conv.sparse_mask() == 0].max()
    engine, _, _, _ = shardwise.initialize(
        model=model,
        config={**config, "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    assert torch.equal(conv.compressed_weight()[0], conv.weight)  # before schedule_offset
    scores = conv.sparse_mask_scores.detach().clone() if method == "topk" else None
    for step in range(2):
        engine.backward(engine(_images(10 + step)).square().mean())
        engine.step()
    mask = conv.sparse_mask().detach()
    assert int((mask == 0).sum()) == 81 and conv.compressed_weight()[0][mask == 0].abs().sum() == 0
    if method == "topk":
        assert not torch.equal(conv.sparse_mask_scores.detach(), scores)  # learned through the mask
    x = _images(3)
    before = model(x)
    redundancy_clean(model, config)
    assert conv.sparse_pruning is None and (conv.weight == 0).sum() >= 81
    torch.testing.assert_close(model(x), before)


def test_quantize_group_size_is_refused_on_a_convolution():
    config = _config(bits=4)
    shared = config["compression_training"]["weight_quantization"]["shared_parameters"]
    del shared["quantize_groups"]
    shared["quantize_group_size"] = 3
    with pytest.raises(ValueError, match="quantize_group_size .* is for nn.Linear layers"):
        init_compression(_model(), config)
