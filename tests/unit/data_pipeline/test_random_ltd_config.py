"""parse_random_ltd reads DeepSpeed's random_ltd keys and refuses bad sections by name;
RandomLTD drives the listed converted layers' kept length and saves/restores the schedule."""

import copy

import pytest
import torch
from torch import nn

from shardwise.config._errors import ConfigError
from shardwise.runtime.data_pipeline.data_routing import (
    RandomLayerTokenDrop,
    RandomLTD,
    convert_to_random_ltd,
    parse_random_ltd,
)

SECTION = {
    "enabled": True,
    "total_layer_num": 4,
    "random_ltd_layer_num": 2,
    "random_ltd_layer_id": [2, 1],
    "model_mask_name": "attention_mask",
    "model_type": "decoder",
    "hidden_state_order": "seq_batch_dim",
    "random_ltd_schedule": {
        "min_value": 16,
        "max_value": 64,
        "schedule_type": "fixed_linear",
        "schedule_config": {"require_steps": 6, "seq_per_step": 8},
    },
    "layer_token_lr_schedule": {"enabled": False},
}


def _with(path, value):
    section = copy.deepcopy(SECTION)
    *parents, key = path.split(".")
    target = section
    for parent in parents:
        target = target[parent]
    target[key] = value
    return section


def test_reads_deepspeed_keys():
    config = parse_random_ltd(SECTION)
    assert config.enabled and config.total_layer_num == 4
    assert config.random_ltd_layer_id == (1, 2) and config.random_ltd_layer_num == 2
    assert (config.model_mask_name, config.model_type, config.hidden_state_order) == (
        "attention_mask",
        "decoder",
        "seq_batch_dim",
    )
    assert (config.schedule.min_value, config.schedule.max_value) == (16, 64)
    assert (config.schedule.require_steps, config.schedule.seq_per_step) == (6, 8)
    assert not parse_random_ltd(None).enabled
    assert not parse_random_ltd({"enabled": False, "total_layer_num": 3}).enabled


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("random_ltd_layer_idd", [1], "did you mean 'data_efficiency.data_routing.random_ltd.random_ltd_layer_id'"),
        ("random_ltd_layer_id", [1, 4], r"\[4\], out of range for total_layer_num 4"),
        ("random_ltd_layer_id", [1, 1], "repeats a layer"),
        ("random_ltd_layer_num", 3, "random_ltd_layer_num is 3 but random_ltd_layer_id lists 2"),
        ("random_ltd_schedule.min_value", 128, r"min_value \(128\) must be <= max_value \(64\)"),
        ("random_ltd_schedule.schedule_config.seq_per_step", 32, "0 kept tokens"),
        ("random_ltd_schedule.schedule_type", "fixed_root", "fixed_linear"),
        ("random_ltd_schedule.schedule_config.require_step", 6, "did you mean"),
        ("hidden_state_order", "batch_first", "batch_seq_dim, seq_batch_dim"),
        ("model_type", "encoder_decoder", "decoder, encoder"),
        ("layer_token_lr_schedule", {"enabled": True}, "refuses it too"),
    ],
)
def test_bad_sections_name_the_key(path, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_random_ltd(_with(path, value))


def test_missing_required_key():
    section = copy.deepcopy(SECTION)
    del section["total_layer_num"]
    with pytest.raises(ConfigError, match="total_layer_num is required"):
        parse_random_ltd(section)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_drives_the_listed_layers_and_resumes():
    model = convert_to_random_ltd(Model(), nn.Linear)
    ltd = RandomLTD.from_config(SECTION, model, global_batch_size=2, token_kwargs=["position_ids"])
    wrapped = [m for m in model.modules() if isinstance(m, RandomLayerTokenDrop)]
    assert ltd.layers == wrapped[1:3]
    assert [m.token_kwargs for m in wrapped] == [(), ("position_ids",), ("position_ids",), ()]
    assert [m.kept_length for m in wrapped] == [None, 16, 16, None]
    assert not ltd.layers[0].batch_first and ltd.layers[0].mask_name == "attention_mask"
    kept = []
    for step in range(8):
        ltd.before_forward(step)
        ltd.before_forward(step)  # a second micro-batch of the same step
        kept.append(wrapped[2].kept_length)
    assert kept == [16, 24, 32, 40, 48, 56, 64, 64]
    # per step: 2 samples * (kept * 2 layers + 64 * 2 other layers)
    assert ltd.consumed_layer_tokens == sum(2 * (k * 2 + 64 * 2) for k in kept)
    assert ltd.forward_kwargs(8) == {} and ltd.scheduler.current_steps == 8
    ltd.before_model_step(8)
    assert ltd.name == "random_ltd" and ltd.scheduler.current_steps == 8
    saved = ltd.state_dict()
    other = RandomLTD.from_config(SECTION, convert_to_random_ltd(Model(), nn.Linear), global_batch_size=2)
    other.load_state_dict(saved)
    assert other.layers[1].kept_length == 64 and other.state_dict() == saved


def test_from_config_refuses_a_model_it_cannot_drive():
    with pytest.raises(ConfigError, match="no RandomLayerTokenDrop layers: call convert_to_random_ltd"):
        RandomLTD.from_config(SECTION, Model(), global_batch_size=2)
    model = convert_to_random_ltd(Model(), nn.Linear)
    del model.layers[2:]
    with pytest.raises(ConfigError, match="names layer 2 but the model has 2 converted layers"):
        RandomLTD.from_config(_with("random_ltd_layer_id", [0, 2]), model, global_batch_size=2)
    with pytest.raises(ConfigError, match="enabled is false"):
        RandomLTD.from_config({"enabled": False}, model, global_batch_size=2)


def test_converted_model_trains_on_fewer_tokens():
    torch.manual_seed(0)
    model = convert_to_random_ltd(Model(), nn.Linear)
    ltd = RandomLTD.from_config(_with("hidden_state_order", "batch_seq_dim"), model, global_batch_size=2)
    seen = []
    model.layers[1].random_ltd_layer.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    model(torch.randn(2, 64, 4)).sum().backward()
    model.eval()
    model(torch.randn(2, 64, 4))
    assert seen == [16, 64]
    assert ltd.layers[0].last_kept_indices.shape == (2, 16)
