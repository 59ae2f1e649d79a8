"""The ``pipeline`` config section: DeepSpeed's keys and the schedule choice."""

import pytest

from shardwise.config import load_config
from shardwise.config._errors import ConfigError


def _load(pipeline):
    return load_config({"train_micro_batch_size_per_gpu": 1, "pipeline": pipeline}, world_size=1)


def test_deepspeed_keys_and_schedules_load():
    _load(
        {
            "stages": "auto",
            "partition": "best",
            "seed_layers": False,
            "activation_checkpoint_interval": 2,
            "pipe_partitioned": True,
            "grad_partitioned": True,
            "schedule": "zero_bubble",
        }
    )
    for schedule in ("1f1b", "1f1b_split", "gpipe"):
        _load({"schedule": schedule})
    _load({"schedule": "interleaved", "virtual_stages": 2})
    _load({"keep_gathered": False})


@pytest.mark.parametrize(
    "pipeline, message",
    [
        ({"schedule": "interleaved", "virtual_stages": 1}, "go with the 'interleaved' schedule only"),
        ({"virtual_stages": 2}, "go with the 'interleaved' schedule only"),
        ({"schedule": "interleaved", "virtual_stages": 0}, "positive integer"),
        ({"schedule": "looped"}, "is not one of"),
        ({"activation_checkpoint_interval": -1}, "non-negative integer"),
        ({"stage": 2}, "pipeline"),
        ({"keep_gathered": "no"}, "pipeline.keep_gathered must be true or false"),
    ],
)
def test_what_the_engine_cannot_honour_is_refused(pipeline, message):
    with pytest.raises(ConfigError, match=message):
        _load(pipeline)


def test_the_default_schedule_splits_the_drain_unless_zero3_releases_layers():
    from shardwise.config._pipeline import schedule_of

    assert schedule_of({}, zero_stage=0) == schedule_of({}, zero_stage=3) == "1f1b_split"
    assert schedule_of({"keep_gathered": False}, zero_stage=3) == "1f1b"  # the split needs the layers
    assert schedule_of({"keep_gathered": False}, zero_stage=2) == "1f1b_split"
    assert schedule_of({"schedule": "gpipe"}, zero_stage=0) == "gpipe"
