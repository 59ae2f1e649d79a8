"""The ``data_efficiency`` section: DeepSpeed 0.19.8's keys and defaults parsed, what an
enabled feature needs named, and each feature refused by name while it is not built."""

import copy

import pytest

from shardwise.config import ConfigError, load_config

METRIC = {
    "index_to_sample_path": "analysis/seqlen_index_to_sample_percentile_merged",
    "index_to_metric_path": "analysis/seqlen_index_to_metric",
    "difficulty_type": "value",
    "clustering_type": "schedule_based",
    "min_difficulty": 80,
    "max_difficulty": 2048,
    "schedule_type": "fixed_root",
    "schedule_config": {"total_curriculum_step": 1000, "difficulty_step": 8, "root_degree": 2},
}
SECTION = {
    "enabled": True,
    "seed": 7,
    "data_sampling": {
        "enabled": True,
        "num_epochs": 3,
        "curriculum_learning": {"enabled": False, "data_cluster_path": "clusters", "curriculum_metrics": {}},
        "dynamic_batching": {"enabled": False, "max_tokens": 4096, "lr_scaling_method": "sqrt"},
    },
    "data_routing": {"enabled": True, "random_ltd": {"enabled": False, "total_layer_num": 24}},
}


def _load(section):
    return load_config({"train_micro_batch_size_per_gpu": 1, "data_efficiency": section}, world_size=1).data_efficiency


def _with(path, value):
    """SECTION with the key at dotted ``path`` set to ``value``."""
    section = copy.deepcopy(SECTION)
    *parents, last = path.split(".")
    node = section
    for key in parents:
        node = node[key]
    node[last] = value
    return section


def test_defaults_are_deepspeeds_and_values_are_read():
    defaults = _load({})
    assert (defaults.enabled, defaults.seed, defaults.data_sampling.num_epochs) == (False, 1234, 1000)
    dynamic = defaults.data_sampling.dynamic_batching
    assert (dynamic.lr_scaling_method, dynamic.min_batch_size, dynamic.max_batch_size) == ("linear", 1, None)
    assert (dynamic.sequence_picking_order, dynamic.verbose, dynamic.max_tokens) == ("dataloader", False, None)
    loaded = _load(SECTION)  # every feature off: nothing to refuse, even with the section switches on
    assert (loaded.seed, loaded.data_sampling.num_epochs) == (7, 3)
    assert loaded.data_sampling.dynamic_batching.lr_scaling_method == "sqrt"
    assert loaded.data_routing.random_ltd == {"enabled": False, "total_layer_num": 24}


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        ("data_sampling.curriculum_learning.enabled", True, r"curriculum_metrics must be a non-empty object"),
        (
            "data_sampling.curriculum_learning",
            {"enabled": True, "curriculum_metrics": {"seqlen": METRIC}},
            r"needs 'data_cluster_path'",
        ),
        (
            "data_sampling.curriculum_learning.curriculum_metrics",
            {"seqlen": {**METRIC, "difficulty_type": "rank"}},
            r"difficulty_type must be one of value, percentile",
        ),
        (
            "data_sampling.curriculum_learning.curriculum_metrics",
            {"seqlen": {k: v for k, v in METRIC.items() if k != "index_to_metric_path"}},
            r"seqlen needs 'index_to_metric_path'",
        ),
        (
            "data_sampling.curriculum_learning.curriculum_metrics",
            {
                "seqlen": {
                    **METRIC,
                    "schedule_type": "fixed_discrete",
                    "schedule_config": {"difficulty": [8, 4], "max_step": [5]},
                }
            },
            r"curriculum_metrics.seqlen.schedule_config.difficulty must be increasing",
        ),
        ("data_sampling.dynamic_batching", {"enabled": True}, r"max_tokens is required"),
        (
            "data_sampling.dynamic_batching",
            {"lr_scaling_method": "cubic"},
            r"lr_scaling_method must be one of linear, sqrt, none",
        ),
        ("data_sampling.num_epoch", 3, r"did you mean 'data_efficiency.data_sampling.num_epochs'"),
        ("data_routing.random_ltd", {"enabled": "yes"}, r"random_ltd.enabled must be true or false"),
    ],
)
def test_what_an_enabled_feature_needs_is_named(path, value, match):
    section = _with(path, value)
    if path.startswith("data_sampling.curriculum_learning.curriculum_metrics"):
        section["data_sampling"]["curriculum_learning"]["enabled"] = True
    with pytest.raises(ConfigError, match=match):
        _load(section)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (
            "data_sampling.curriculum_learning",
            {"enabled": True, "data_cluster_path": "c", "curriculum_metrics": {"seqlen": METRIC}},
        ),
        ("data_sampling.dynamic_batching", {"enabled": True, "max_tokens": 4096}),
    ],
)
def test_each_feature_is_switched_on_by_its_own_enabled(path, value):
    section = _with(path, value)
    section["enabled"] = False  # DeepSpeed switches a feature on by its own "enabled" alone
    config = _load(section)
    feature = config.data_sampling
    for part in path.split(".")[1:]:
        feature = getattr(feature, part)
    assert feature.enabled


def test_an_enabled_random_ltd_section_is_checked_when_the_config_is_read():
    section = _with("data_routing", {"random_ltd": {"enabled": True}})
    section["enabled"] = False  # its own "enabled" alone switches it on
    with pytest.raises(ConfigError, match="random_ltd.total_layer_num is required when random-LTD is enabled"):
        _load(section)
