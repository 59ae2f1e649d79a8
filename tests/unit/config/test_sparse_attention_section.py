"""The ``sparse_attention`` config section: DeepSpeed's modes, keys and defaults, and the
sparsity config object it builds."""

import logging

import pytest

from shardwise.config import load_config
from shardwise.config._errors import ConfigError
from shardwise.config._sparse_attention import sparse_attention_section
from shardwise.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    VariableSparsityConfig,
    sparsity_config_from_dict,
)
from shardwise.runtime.config import DeepSpeedConfig


def test_defaults_are_deepspeeds():
    assert sparse_attention_section({}) == {
        "mode": "fixed",
        "block": 16,
        "different_layout_per_head": False,
        "num_local_blocks": 4,
        "num_global_blocks": 1,
        "attention": "bidirectional",
        "horizontal_global_attention": False,
        "num_different_global_patterns": 1,
    }
    assert sparse_attention_section({"mode": "dense"}) == {"mode": "dense", "block": 16}
    assert sparse_attention_section({"mode": "bslongformer", "block": 64}) == {
        "mode": "bslongformer",
        "block": 64,
        "different_layout_per_head": False,
        "num_sliding_window_blocks": 3,
        "global_block_indices": [0],
        "global_block_end_indices": None,
    }
    assert sparse_attention_section(None) is None


@pytest.mark.parametrize(
    "section, cls, attrs",
    [
        ({"mode": "dense", "block": 32}, DenseSparsityConfig, {"block": 32}),
        (
            {"mode": "fixed", "num_local_blocks": 2, "attention": "unidirectional"},
            FixedSparsityConfig,
            {"num_local_blocks": 2, "attention": "unidirectional"},
        ),
        (
            {"mode": "variable", "num_random_blocks": 1, "local_window_blocks": [2, 3]},
            VariableSparsityConfig,
            {"num_random_blocks": 1, "local_window_blocks": [2, 3]},
        ),
        (
            {"mode": "bigbird", "num_sliding_window_blocks": 5, "num_global_blocks": 2},
            BigBirdSparsityConfig,
            {"num_sliding_window_blocks": 5, "num_global_blocks": 2, "num_random_blocks": 0},
        ),
        (
            {"mode": "bslongformer", "global_block_indices": [0, 4], "global_block_end_indices": [1, 5]},
            BSLongformerSparsityConfig,
            {"global_block_indices": [0, 4], "global_block_end_indices": [1, 5]},
        ),
    ],
)
def test_each_mode_builds_its_config_class(section, cls, attrs):
    config = sparsity_config_from_dict(section, num_heads=4)
    assert type(config) is cls and config.num_heads == 4
    for name, value in attrs.items():
        assert list(getattr(config, name)) == value if isinstance(value, list) else getattr(config, name) == value


def test_section_loads_in_a_training_config_and_deepspeed_config_resolves_it():
    raw = {"train_micro_batch_size_per_gpu": 1, "sparse_attention": {"mode": "bigbird", "block": 32}}
    load_config(raw, world_size=1)
    resolved = DeepSpeedConfig(raw).sparse_attention
    assert resolved["mode"] == "bigbird" and resolved["block"] == 32 and resolved["num_global_blocks"] == 1
    assert DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1}).sparse_attention is None


@pytest.mark.parametrize(
    "section, message",
    [
        ({"mode": "longformer"}, "sparse_attention.mode='longformer' is not one of"),
        ({"mode": "fixed", "num_local_block": 4}, "num_local_blocks"),
        ({"mode": "fixed", "block": 0}, "sparse_attention.block must be a positive integer"),
        ({"mode": "fixed", "attention": "causal"}, "sparse_attention.attention must be one of"),
        ({"mode": "variable", "local_window_blocks": 4}, "non-empty list of integers"),
        ({"mode": "bslongformer", "different_layout_per_head": "yes"}, "must be true or false"),
    ],
)
def test_bad_sections_are_refused_by_name(section, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"train_micro_batch_size_per_gpu": 1, "sparse_attention": section}, world_size=1)


def test_another_modes_keys_are_named_once(caplog):
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        resolved = sparse_attention_section({"mode": "bslongformer", "num_random_blocks": 2, "num_local_blocks": 4})
    assert "num_random_blocks" not in resolved
    lines = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert lines == ["sparse_attention keys with no effect in mode 'bslongformer': num_local_blocks, num_random_blocks"]


def test_a_mismatch_the_classes_catch_is_a_value_error():
    with pytest.raises(ValueError, match="num_different_global_patterns"):
        sparsity_config_from_dict({"mode": "fixed", "num_different_global_patterns": 3}, num_heads=4)
