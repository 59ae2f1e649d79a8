"""The ``pipeline`` section: the pipeline engine's settings, DeepSpeed's keys plus the
schedule choice."""

from __future__ import annotations

from typing import Any

from shardwise.config._errors import ConfigError, check_keys

SCHEDULES = ("1f1b", "1f1b_split", "gpipe", "zero_bubble", "interleaved")
"""Schedules the pipeline engine runs (``interleaved`` with ``virtual_stages`` model
chunks per stage, which ``PipelineModule(virtual_stages=...)`` must also have)."""

DEFAULT_SCHEDULE = "1f1b_split"
"""The schedule run when ``pipeline.schedule`` is not given: DeepSpeed's 1F1B order with the
drain's backwards split (measured never slower than ``1f1b``: bench/results
2026-11-26-cpu-pipeline-zero-bubble.md and 2026-11-28-cpu-pipeline-balance.md); at ZeRO stage 3
with ``keep_gathered: false``, which a split backward cannot serve, ``1f1b``."""


def schedule_of(section: dict, *, zero_stage: int) -> str:
    """The schedule a (checked) ``pipeline`` section runs at ``zero_stage``."""
    if "schedule" in section:
        return section["schedule"]
    if zero_stage == 3 and not section.get("keep_gathered", True):
        return "1f1b"
    return DEFAULT_SCHEDULE


def check_pipeline(section: Any) -> None:
    """Validate a ``pipeline`` section; refuse what the engine cannot honour, by name."""
    check_keys(
        "pipeline",
        section,
        {
            "stages",
            "partition",
            "seed_layers",
            "activation_checkpoint_interval",
            "pipe_partitioned",
            "grad_partitioned",
            "schedule",
            "virtual_stages",
            "keep_gathered",
        },
    )
    if not isinstance(section.get("keep_gathered", True), bool):
        raise ConfigError(f"pipeline.keep_gathered must be true or false, got {section['keep_gathered']!r}")
    schedule = section.get("schedule", DEFAULT_SCHEDULE)
    virtual = section.get("virtual_stages", 2 if schedule == "interleaved" else 1)
    if not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 1:
        raise ConfigError(f"pipeline.virtual_stages must be a positive integer, got {virtual!r}")
    if (schedule == "interleaved") != (virtual > 1):
        raise ConfigError(
            f"pipeline.virtual_stages={virtual} with schedule {schedule!r}: model chunks per stage "
            "(virtual_stages > 1) go with the 'interleaved' schedule only"
        )
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule={schedule!r} is not one of {list(SCHEDULES)}")
    interval = section.get("activation_checkpoint_interval", 0)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise ConfigError(f"pipeline.activation_checkpoint_interval must be a non-negative integer, got {interval!r}")
