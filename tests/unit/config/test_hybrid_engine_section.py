"""The ``hybrid_engine`` config section: DeepSpeed 0.19.8's keys and defaults, bad input
refused by name."""

import pytest

from shardwise.config import load_config
from shardwise.config._errors import ConfigError
from shardwise.config._hybrid_engine import HybridEngineConfig


def _load(section):
    return load_config({"train_micro_batch_size_per_gpu": 1, "hybrid_engine": section}, world_size=1)


def test_defaults_are_deepspeeds():
    config = load_config({"train_micro_batch_size_per_gpu": 1}, world_size=1).hybrid_engine
    assert config == HybridEngineConfig(
        enabled=False,
        max_out_tokens=512,
        inference_tp_size=1,
        release_inference_cache=False,
        pin_parameters=True,
        tp_gather_partition_size=8,
        enable_cuda_graph=False,
    )


def test_every_key_is_held():
    section = {
        "enabled": True,
        "max_out_tokens": 64,
        "inference_tp_size": 2,
        "release_inference_cache": True,
        "pin_parameters": False,
        "tp_gather_partition_size": 2.0,
        "enable_cuda_graph": True,
    }
    config = _load(section).hybrid_engine
    assert config == HybridEngineConfig(**{**section, "tp_gather_partition_size": 2})


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"'hybrid_engine.max_out_token'; did you mean 'hybrid_engine.max_out_tok"):
        _load({"max_out_token": 8})


@pytest.mark.parametrize(
    "section,message",
    [
        ({"enabled": "yes"}, "hybrid_engine.enabled must be true or false"),
        ({"max_out_tokens": 0}, "hybrid_engine.max_out_tokens must be a positive integer"),
        ({"inference_tp_size": 0}, "hybrid_engine.inference_tp_size must be a positive integer"),
        ({"tp_gather_partition_size": 1.5}, "hybrid_engine.tp_gather_partition_size must be a positive integer"),
        ([], "'hybrid_engine' must be a JSON object"),
    ],
)
def test_bad_values_name_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        _load(section)


def test_inference_tp_size_must_divide_the_world():
    with pytest.raises(ConfigError, match=r"inference_tp_size=3 does not divide the 4 rank"):
        HybridEngineConfig(inference_tp_size=3).check_world(4)
    HybridEngineConfig(inference_tp_size=2).check_world(4)
    HybridEngineConfig().check_world(4)
