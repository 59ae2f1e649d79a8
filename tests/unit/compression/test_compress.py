"""init_compression, the engine's compression schedule, checkpoints and redundancy_clean."""

import pytest
import torch
from torch import nn

import shardwise
from shardwise.compression.compress import (
    convert_conv1d_to_linear,
    init_compression,
    redundancy_clean,
    student_initialization,
)
from shardwise.config import ConfigError
from shardwise.testing.models import TinyMLP, token_batches


def _technique(name, params, modules, shared=None, related=None):
    group = {"params": params, "modules": modules}
    if related is not None:
        group["related_modules"] = related
    return {name: {"shared_parameters": {"enabled": True, **(shared or {})}, "different_groups": {"g": group}}}


def _config(compression, stage=0):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "compression_training": compression,
    }


PRUNING = {
    **_technique("sparse_pruning", {"dense_ratio": 0.25}, ["fc1"], {"schedule_offset": 2}),
    **_technique("row_pruning", {"dense_ratio": 0.5}, ["fc2"], {"schedule_offset": 0}),
}


def _train(engine, steps):
    for tokens, targets in token_batches(num_steps=steps, batch=4, seed=5):
        engine.backward(engine(tokens, targets))
        engine.step()


def test_masks_hit_the_dense_ratio_follow_the_offset_and_survive_steps_and_checkpoints(tmp_path):
    model = init_compression(TinyMLP(seed=1), {"compression_training": PRUNING})
    fc1, fc2 = model.fc1, model.fc2
    assert fc1.sparse_pruning_mask.sum() == 0.25 * fc1.weight.numel()
    assert fc2.row_pruning_mask.sum() == fc2.out_features // 2
    engine, _, _, _ = shardwise.initialize(model=model, config=_config(PRUNING))
    assert torch.equal(fc1.compressed_weight()[0], fc1.weight)  # sparse pruning starts at step 2
    _train(engine, 2)
    pruned = fc1.weight.detach() * fc1.sparse_pruning_mask
    assert torch.equal(fc1.compressed_weight()[0], pruned)
    _train(engine, 2)
    weight, bias = fc2.compressed_weight()
    rows = fc2.row_pruning_mask.view(-1) == 0
    assert weight[rows].abs().sum() == 0 and bias[rows].abs().sum() == 0 and weight[~rows].abs().sum() > 0
    assert (fc1.compressed_weight()[0] != 0).sum() <= 0.25 * fc1.weight.numel()
    engine.save_checkpoint(str(tmp_path))

    fresh = init_compression(TinyMLP(seed=7), {"compression_training": PRUNING})
    resumed, _, _, _ = shardwise.initialize(model=fresh, config=_config(PRUNING))
    resumed.load_checkpoint(str(tmp_path))
    assert torch.equal(fresh.fc1.sparse_pruning_mask, fc1.sparse_pruning_mask)
    assert fresh.fc1.step == fc1.step == 4
    tokens, targets = token_batches(num_steps=1, batch=4, seed=9)[0]
    assert torch.equal(resumed(tokens, targets), engine(tokens, targets))


def test_the_engine_moves_the_weight_bits_at_deepspeeds_steps():
    compression = _technique(
        "weight_quantization",
        {"start_bits": 8, "target_bits": 6, "quantization_period": 1},
        ["fc"],
        {"schedule_offset": 1},
    )
    model = init_compression(TinyMLP(seed=1), {"compression_training": compression})
    engine, _, _, _ = shardwise.initialize(model=model, config=_config(compression))
    seen = []
    for tokens, targets in token_batches(num_steps=5, batch=4, seed=5):
        seen.append(model.fc1.current_bits())
        engine.backward(engine(tokens, targets))
        engine.step()
    assert seen == [None, None, 7, 6, 6]
    assert engine.training_features.state_dict() == {"compression_training": {"training_steps": 5}}


class _Attention(nn.Module):
    """Self-attention whose head count follows its Q projection (so heads can be removed)."""

    def __init__(self, width=16, head_dim=4):
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(width, 24), nn.Linear(24, width)

    def forward(self, x):
        batch, seq, _ = x.shape
        heads = self.q.out_features // self.head_dim
        q, k, v = (p(x).view(batch, seq, heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        mixed = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        h = x + self.o(mixed.transpose(1, 2).reshape(batch, seq, -1))
        return h + self.fc2(torch.relu(self.fc1(h)))


CLEAN = {
    **_technique(
        "weight_quantization", {"start_bits": 8, "target_bits": 8}, ["fc1"], {"quantize_weight_in_forward": True}
    ),
    **_technique("sparse_pruning", {"dense_ratio": 0.5}, ["fc2"], {"schedule_offset": 0, "method": "topk"}),
    **_technique("row_pruning", {"dense_ratio": 0.5}, ["fc1"], {"schedule_offset": 0}, related=[["fc2"]]),
    **_technique(
        "head_pruning",
        {"dense_ratio": 0.5},
        [r"\.o$|^o$"],
        {"schedule_offset": 0, "num_heads": 4},
        related=[["^q$", "^k$", "^v$"]],
    ),
    **_technique("activation_quantization", {"bits": 8}, ["fc2"], {"schedule_offset": 0}),
}


def test_redundancy_clean_removes_rows_and_heads_and_keeps_the_outputs():
    torch.manual_seed(0)
    model = init_compression(_Attention(), {"compression_training": CLEAN})
    x = torch.randn(2, 5, 16)
    before = model(x).detach()
    count = sum(p.numel() for n, p in model.named_parameters() if "scores" not in n)
    redundancy_clean(model, {"compression_training": CLEAN})
    assert (model.fc1.out_features, model.fc2.in_features) == (12, 12)
    assert (model.q.out_features, model.k.out_features, model.v.out_features, model.o.in_features) == (8, 8, 8, 8)
    assert sum(p.numel() for p in model.parameters()) < count
    assert torch.allclose(model(x), before, atol=1e-6, rtol=0)
    assert model.fc1.weight.unique().numel() <= 256


def test_without_related_modules_pruned_rows_are_zeroed_in_place():
    compression = _technique("row_pruning", {"dense_ratio": 0.5}, ["fc1"], {"schedule_offset": 0})
    model = init_compression(TinyMLP(seed=1), {"compression_training": compression})
    tokens, targets = token_batches(num_steps=1, batch=2, seed=3)[0]
    before = model(tokens, targets)
    redundancy_clean(model, {"compression_training": compression})
    assert model.fc1.weight.shape == (32, 16) and (model.fc1.weight.abs().sum(dim=1) == 0).sum() == 16
    assert torch.allclose(model(tokens, targets), before, atol=1e-6, rtol=0)


class _Stack(nn.Module):
    def __init__(self, depth, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(depth))


def test_layer_reduction_copies_the_named_teacher_layers():
    teacher, student = _Stack(6, seed=0), _Stack(2, seed=1)
    section = {
        "layer_reduction": {
            "enabled": True,
            "module_name_prefix": "layers",
            "teacher_layer": [1, 4],
            "other_module_name": ["embed"],
        }
    }
    init_compression(student, {"compression_training": section}, teacher_model=teacher)
    for position, index in enumerate([1, 4]):
        assert torch.equal(student.layers[position].weight, teacher.layers[index].weight)
    assert torch.equal(student.embed.bias, teacher.embed.bias)
    section["layer_reduction"]["teacher_layer"] = [1, 6]
    with pytest.raises(ValueError, match="asks for layer 6, but the teacher has 6 layers"):
        student_initialization(student, teacher, {"compression_training": section})


@pytest.mark.parametrize(
    "compression, error, message",
    [
        (_technique("row_pruning", {"dense_ratio": 0.5}, ["attn"]), ValueError, "'attn' matches no nn.Linear"),
        (
            _technique("row_pruning", {"dense_ratio": 0.5}, ["embed"]),
            ValueError,
            "matches embed, which are not nn.Linear",
        ),
        (_technique("row_pruning", {"dense_ratio": 0.5}, ["fc", "fc1"]), ValueError, "'fc1' is already compressed"),
        (
            _technique("weight_quantization", {"start_bits": 8, "target_bits": 8}, ["fc1"], {"quantize_groups": 5}),
            ValueError,
            "quantize_groups=5",
        ),
        (
            _technique("head_pruning", {"dense_ratio": 0.5}, ["fc2"], {"num_heads": 2, "method": "l1"}),
            ValueError,
            "'topk' only",
        ),
        (
            _technique("head_pruning", {"dense_ratio": 0.5}, ["fc2"], {"num_heads": 5}),
            ValueError,
            "num_heads=5 does not divide",
        ),
        (_technique("row_pruning", {"dense_ratio": 0.5}, ["fc("]), ValueError, "not a valid regular expression"),
    ],
)
def test_init_compression_names_what_cannot_be_compressed(compression, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace("[", r"\[")):
        init_compression(TinyMLP(seed=1), {"compression_training": compression})


def test_the_engine_refuses_zero3_and_a_config_that_does_not_match_the_model():
    compression = _technique("row_pruning", {"dense_ratio": 0.5}, ["fc1"])
    with pytest.raises(ConfigError, match="not available with ZeRO stage 3"):
        shardwise.initialize(
            model=init_compression(TinyMLP(seed=1), {"compression_training": compression}),
            config=_config(compression, stage=3),
        )
    with pytest.raises(ConfigError, match="call shardwise.compression.compress.init_compression"):
        shardwise.initialize(model=TinyMLP(seed=1), config=_config(compression))
    compressed = init_compression(TinyMLP(seed=1), {"compression_training": compression})
    plain = {k: v for k, v in _config(compression).items() if k != "compression_training"}
    with pytest.raises(ConfigError, match="enables no compression_training technique to schedule them"):
        shardwise.initialize(model=compressed, config=plain)
    redundancy_clean(compressed, {"compression_training": compression})
    shardwise.initialize(model=compressed, config=plain)  # folded in: nothing left to schedule


class _Conv1D(nn.Module):
    """transformers' Conv1D layout: weight (in, out), y = x @ W + b."""

    def __init__(self, fan_out, fan_in):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(fan_in, fan_out))
        self.bias = nn.Parameter(torch.randn(fan_out))

    def forward(self, x):
        return x @ self.weight + self.bias


def test_conv1d_layers_become_equal_linears_that_patterns_can_name():
    model = nn.Sequential(_Conv1D(6, 4), nn.ReLU(), _Conv1D(3, 6))
    x = torch.randn(5, 4)
    before = model(x)
    convert_conv1d_to_linear(model, _Conv1D)
    assert isinstance(model[0], nn.Linear) and (model[0].in_features, model[0].out_features) == (4, 6)
    assert torch.allclose(model(x), before, atol=1e-6, rtol=0)


class _ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_a_subclass_of_linear_is_refused_not_silently_replaced():
    compression = _technique("row_pruning", {"dense_ratio": 0.5}, ["0"])
    with pytest.raises(ValueError, match="_ScaledLinear is a subclass of nn.Linear"):
        init_compression(nn.Sequential(_ScaledLinear(4, 4)), {"compression_training": compression})
