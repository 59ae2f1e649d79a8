"""The ``pipeline`` section: the pipeline engine's settings, DeepSpeed's keys plus the
schedule choice."""

from __future__ import annotations

from typing import Any

from shardwise.config._errors import ConfigError, check_keys

SCHEDULES = ("1f1b", "gpipe", "zero_bubble")
"""Schedules the pipeline engine runs (``shardwise.pipe.schedules`` also defines
``interleaved``, whose virtual stages the engine does not hold yet)."""


def check_pipeline(section: Any) -> None:
    """Validate a ``pipeline`` section; refuse what the engine cannot honour, by name."""
    check_keys("pipeline", section, {"stages", "partition", "seed_layers", "activation_checkpoint_interval",
                                     "pipe_partitioned", "grad_partitioned", "schedule", "virtual_stages"})
    schedule = section.get("schedule", "1f1b")
    if schedule == "interleaved" or section.get("virtual_stages", 1) not in (1, None):
        raise ConfigError("pipeline.schedule 'interleaved' / virtual_stages > 1: the schedule exists "
                          "(shardwise.pipe.schedules) but the pipeline engine does not hold several model chunks "
                          f"per stage yet; use one of {list(SCHEDULES)}")
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule={schedule!r} is not one of {list(SCHEDULES)}")
    interval = section.get("activation_checkpoint_interval", 0)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise ConfigError(f"pipeline.activation_checkpoint_interval must be a non-negative integer, got {interval!r}")
