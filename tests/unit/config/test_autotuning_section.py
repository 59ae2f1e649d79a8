"""The ``autotuning`` section: DeepSpeed 0.19.8's keys and defaults, errors that name the fix."""

import pytest

from shardwise.config import ConfigError, load_config


def _load(section):
    return load_config({"train_micro_batch_size_per_gpu": 1, "autotuning": section}, world_size=1)


def test_defaults_are_deepspeeds():
    tuning = _load({}).autotuning
    assert (tuning.enabled, tuning.fast, tuning.overwrite) == (False, True, True)
    assert (tuning.results_dir, tuning.exps_dir) == ("autotuning_results", "autotuning_exps")
    assert (tuning.start_profile_step, tuning.end_profile_step) == (3, 5)
    assert (tuning.metric, tuning.tuner_type) == ("throughput", "gridsearch")
    assert (tuning.tuner_early_stopping, tuning.tuner_num_trials) == (5, 50)
    assert (tuning.min_train_micro_batch_size_per_gpu, tuning.max_train_micro_batch_size_per_gpu) == (1, 1024)
    assert (tuning.num_tuning_micro_batch_sizes, tuning.mp_size, tuning.max_train_batch_size) == (3, 1, None)


def test_enabled_section_loads_with_model_info():
    tuning = _load({"enabled": True, "tuner_type": "Random", "model_info": {"num_params": 1e6}}).autotuning
    assert tuning.enabled and tuning.tuner_type == "random" and tuning.model_info.num_params == 1_000_000
    assert _load({"metric": "FLOPS"}).autotuning.metric == "flops"


@pytest.mark.parametrize(
    "typo,suggestion",
    [("tuner_num_trail", "autotuning.tuner_num_trials"), ("end_profile_stp", "autotuning.end_profile_step")],
)
def test_unknown_key_did_you_mean(typo, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        _load({typo: 1})


def test_model_info_unknown_key():
    with pytest.raises(ConfigError, match="did you mean 'autotuning.model_info.num_params'"):
        _load({"model_info": {"num_param": 3}})


@pytest.mark.parametrize(
    "section,match",
    [
        (
            {"min_train_micro_batch_size_per_gpu": 8, "max_train_micro_batch_size_per_gpu": 4},
            r"min_train_micro_batch_size_per_gpu \(8\) is greater than autotuning.max_train_micro_batch_size_per_gpu",
        ),
        (
            {"min_train_batch_size": 64, "max_train_batch_size": 32},
            r"min_train_batch_size \(64\) is greater than autotuning.max_train_batch_size \(32\)",
        ),
        ({"start_profile_step": 6, "end_profile_step": 5}, "end_profile_step .5. is before start_profile_step"),
        ({"metric": "flop"}, "metric must be one of throughput, latency, flops"),
        ({"tuner_type": "bayes"}, "tuner_type must be one of gridsearch, random, model_based"),
        ({"experiment_timeout_s": 0}, "experiment_timeout_s must be > 0"),
    ],
)
def test_bad_values_name_the_key(section, match):
    with pytest.raises(ConfigError, match=match):
        _load(section)
