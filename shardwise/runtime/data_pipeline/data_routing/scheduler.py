"""The random-LTD kept-length schedule (random layerwise token drop, arXiv 2211.11586).

Same API and values as DeepSpeed 0.19.8's ``RandomLTDScheduler``: ``update_seq(step)``
moves the kept length along the ``fixed_linear`` ramp and counts the layer tokens the step
consumes (once per global step, however many micro-batches call it); ``state_dict`` holds
DeepSpeed's keys, so a checkpoint's ``random_ltd`` entry reads either way. Pure Python.
"""

from __future__ import annotations

import math
from typing import Any

from shardwise.config._errors import ConfigError
from shardwise.runtime.data_pipeline.data_routing._config import PATH, RandomLTDConfig, parse_random_ltd


def kept_length(global_steps: int, low: int, high: int, *, require_steps: int, seq_per_step: int) -> int:
    """The ``fixed_linear`` kept length at ``global_steps``: the linear ramp from ``low``
    to ``high`` over ``require_steps``, floored, rounded down to a multiple of
    ``seq_per_step``, capped at ``high``."""
    value = math.floor(float(global_steps) / require_steps * (high - low) + low)
    value -= value % seq_per_step
    return min(value, high)


def _as_config(config: Any) -> RandomLTDConfig:
    if isinstance(config, RandomLTDConfig):
        parsed = config
    else:
        parsed = parse_random_ltd({"enabled": True, **config})
    if not parsed.enabled or parsed.schedule is None:
        raise ConfigError(f"{PATH} is disabled: a RandomLTDScheduler needs an enabled section")
    return parsed


class RandomLTDScheduler:
    """How many tokens each random-LTD layer keeps per sample at the current step.

    ``config``: a ``RandomLTDConfig`` or DeepSpeed's section dict (the ``random_ltd`` keys,
    ``enabled`` implied). ``global_batch_size`` (samples per optimizer step) overrides the
    section's engine-set key of that name; one of the two is required, as in DeepSpeed,
    because the consumed-layer-token count is per global batch.
    """

    def __init__(self, config: Any, *, global_batch_size: int | None = None):
        self.config = _as_config(config)
        self.global_batch_size = global_batch_size or self.config.global_batch_size
        if not self.global_batch_size:
            raise ConfigError(
                f"{PATH}.global_batch_size is missing: the engine sets it to train_batch_size; "
                f"outside an engine pass RandomLTDScheduler(config, global_batch_size=...)"
            )
        self.reset_to_init()

    @property
    def model_layer_num(self) -> int:
        """All transformer layers (``total_layer_num``)."""
        return self.config.total_layer_num

    @property
    def random_ltd_layer_num(self) -> int:
        """Layers that drop tokens."""
        return self.config.random_ltd_layer_num

    def reset_to_init(self) -> None:
        """Back to the start of the schedule: ``min_value`` kept, nothing consumed."""
        schedule = self.config.schedule
        self.min_value = schedule.min_value
        self.max_value = schedule.max_value
        self.current_value = schedule.min_value
        self.consumed_layer_tokens = 0
        self.current_steps = -1

    def get_current_seq(self) -> int:
        """Tokens each random-LTD layer keeps per sample now."""
        return self.current_value

    def set_current_seq(self, seq_length: int) -> None:
        """Force the kept length (DeepSpeed's escape hatch; the schedule resumes from it)."""
        self.current_value = seq_length

    def get_random_ltd_layer_num(self) -> int:
        """Layers that drop tokens."""
        return self.random_ltd_layer_num

    def update_seq(self, global_steps: int) -> None:
        """Move to ``global_steps``: grow the kept length (never past or back from
        ``max_value``) and, the first time this step is seen, add the layer tokens it uses:
        ``global_batch_size * (kept * ltd layers + max_value * other layers)``."""
        if self.current_value < self.max_value:
            schedule = self.config.schedule
            self.current_value = kept_length(
                global_steps,
                self.min_value,
                self.max_value,
                require_steps=schedule.require_steps,
                seq_per_step=schedule.seq_per_step,
            )
        if global_steps != self.current_steps:
            other_layers = self.model_layer_num - self.random_ltd_layer_num
            per_sample = self.current_value * self.random_ltd_layer_num + self.max_value * other_layers
            self.consumed_layer_tokens += self.global_batch_size * per_sample
            self.current_steps = global_steps

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """Layer tokens a run of ``train_iters`` steps consumes, stepping this scheduler
        through steps ``0 .. train_iters - 1`` (as DeepSpeed's does; call it on a fresh one)."""
        for step in range(train_iters):
            self.update_seq(step)
        return self.consumed_layer_tokens

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps, under DeepSpeed's key names."""
        return {
            "consumed_layer_tokens": self.consumed_layer_tokens,
            "current_steps": self.current_steps,
            "current_value": self.current_value,
            "min_value": self.min_value,
            "max_value": self.max_value,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Continue exactly where ``state_dict`` was taken."""
        self.consumed_layer_tokens = state_dict["consumed_layer_tokens"]
        self.current_steps = state_dict["current_steps"]
        self.current_value = state_dict["current_value"]
        self.min_value = state_dict["min_value"]
        self.max_value = state_dict["max_value"]

    get_state = state_dict
    set_state = load_state_dict
