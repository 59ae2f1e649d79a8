"""The compression_training section: DeepSpeed's keys and defaults, clear errors, and the
techniques this version does not build refused by name."""

import pytest

from shardwise.config import ConfigError, load_config
from shardwise.config._compression import compression_config


def _wq(shared=None, params=None, **group):
    return {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, **(shared or {})},
            "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 4, **(params or {})}, **group}},
        }
    }


def _pruning(technique, shared=None, ratio=0.5):
    return {
        technique: {
            "shared_parameters": {"enabled": True, **(shared or {})},
            "different_groups": {"p1": {"params": {"dense_ratio": ratio}, "modules": ["fc"]}},
        }
    }


def test_defaults_are_deepspeeds():
    config = compression_config({"weight_quantization": {"shared_parameters": {"enabled": False}}})
    assert not config.enabled
    assert config.weight_quantization.shared == {
        "enabled": False,
        "quantizer_kernel": False,
        "schedule_offset": 0,
        "quantize_groups": 1,
        "quantize_verbose": False,
        "quantization_type": "symmetric",
        "rounding": "nearest",
        "quantize_weight_in_forward": False,
        "fp16_mixed_quantize": {},
    }
    assert config.activation_quantization.shared["schedule_offset"] == 1000
    assert config.activation_quantization.shared["range_calibration"] == "dynamic"
    assert (config.sparse_pruning.shared["method"], config.sparse_pruning.shared["schedule_offset"]) == ("l1", 1000)
    assert config.row_pruning.shared["method"] == "l1" and config.head_pruning.shared["method"] == "topk"


def test_groups_take_patterns_related_modules_and_the_period_default():
    config = compression_config(_wq(modules=["attn.q", "mlp"], related_modules=[["x"], ["y", "z"]]))
    (group,) = config.weight_quantization.groups
    assert group.params == {"start_bits": 8, "target_bits": 4, "quantization_period": 1}
    assert group.modules == ("attn.q", "mlp") and group.related_modules == (("x",), ("y", "z"))
    assert compression_config(_wq()).weight_quantization.groups[0].modules == (".*",)  # DeepSpeed's "*"


def test_the_engine_config_carries_the_section():
    config = load_config({"train_batch_size": 1, "compression_training": _wq()}, world_size=1)
    assert config.compression_training.enabled


@pytest.mark.parametrize(
    "section, message",
    [
        (
            _wq(shared={"quantize_group": 2}),
            "did you mean 'compression_training.weight_quantization.shared_parameters.quantize_groups'",
        ),
        (_wq(params={"target_bits": 0}), "target_bits must be an integer from 1 to 16"),
        (_wq(params={"start_bits": 17}), "start_bits must be an integer from 1 to 16"),
        (_wq(params={"start_bits": 4, "target_bits": 8}), "target_bits (8) must not exceed start_bits (4)"),
        (_wq(shared={"quantization_type": "asymmetric"}, params={"target_bits": 2}), "ternary/binary"),
        (_wq(shared={"rounding": "floor"}), "rounding must be one of nearest, stochastic"),
        ({"weight_quantization": {"shared_parameters": {"enabled": True}}}, "needs 'different_groups'"),
        (_pruning("sparse_pruning", ratio=0.0), "dense_ratio must be in (0, 1]"),
        (_pruning("row_pruning", ratio=1.5), "dense_ratio must be in (0, 1]"),
        (_pruning("row_pruning", shared={"method": "l2"}), "did you mean 'l1'"),
        (_pruning("head_pruning"), "needs 'num_heads'"),
        (_pruning("channel_pruning", shared={"method": "l2"}), "did you mean 'l1'"),
        (
            _pruning("sparse_pruning", shared={"method": "snip_momentum", "block_pattern": "2:4"}),
            "dense_ratio 0.1 prunes 90% of the weights, but block_pattern '2:4' prunes at most 2 of every 4",
        ),
        (_wq(shared={"fp16_mixed_quantize": {"enabled": True}}), "fp16_mixed_quantize"),
        (
            {
                "activation_quantization": {
                    "shared_parameters": {"enabled": True},
                    "different_groups": {"a": {"params": {"bits": 6}}},
                }
            },
            "bits must be 4 or 8",
        ),
        (_wq(modules=["a"], related_modules=[["b"], ["c"]]), "one list of patterns per entry of modules (1)"),
        (
            {
                "layer_reduction": {
                    "enabled": True,
                    "module_name_prefix": "h",
                    "teacher_layer": [1, 3],
                    "keep_number_layer": 3,
                }
            },
            "keep_number_layer (3) must equal the length of teacher_layer (2)",
        ),
        ({"weight_quantisation": {}}, "did you mean 'compression_training.weight_quantization'"),
        (
            {"row_pruning": {"different_groups": {"g": {"params": {"dense_ratio": 0.5}, "module": ["fc"]}}}},
            "did you mean 'compression_training.row_pruning.different_groups.g.modules'",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(section, message):
    with pytest.raises(ConfigError) as info:
        compression_config(section)
    assert message in str(info.value)
