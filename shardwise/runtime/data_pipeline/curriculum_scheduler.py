"""DeepSpeed's ``CurriculumScheduler``: the difficulty (for a sequence-length curriculum,
the sequence length) as a function of the optimizer step.

The fixed schedules are the pure function :func:`scheduled_difficulty`; the scheduler
adds what DeepSpeed's class holds: the current difficulty, which stops moving once it
reaches ``max_difficulty``, and a user function for ``schedule_type: custom``. Values
equal DeepSpeed 0.19.8's for every schedule (``tests/unit/data_pipeline``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping

from shardwise.config._data_efficiency import CurriculumScheduleConfig, curriculum_schedule_config


def _root_difficulty(schedule: CurriculumScheduleConfig, step: int, root_degree) -> int | float:
    """fixed_root (fixed_linear with ``root_degree`` 1): the fraction of the curriculum done,
    to the power 1/root_degree, scaled to the difficulty range, floored to a multiple of
    ``difficulty_step`` but never below the first such multiple at or above
    ``min_difficulty`` (a zero-length sequence otherwise), and capped at ``max_difficulty``."""
    low, high, unit = schedule.min_difficulty, schedule.max_difficulty, schedule.difficulty_step
    done = (float(step) / schedule.total_curriculum_step) ** (1.0 / root_degree)
    value = math.floor(done * (high - low) + low)
    value -= value % unit
    first = -(-low // unit) * unit  # ceil(low / unit) * unit, exact for integers
    return min(max(value, first), high)


def _discrete_difficulty(schedule: CurriculumScheduleConfig, step: int) -> int | float:
    """fixed_discrete: ``difficulty[i]`` up to and including ``max_step[i]``; the last
    difficulty after the last ``max_step``."""
    for difficulty, last_step in zip(schedule.difficulty, schedule.max_step):
        if step <= last_step:
            return difficulty
    return schedule.difficulty[-1]


def scheduled_difficulty(schedule: CurriculumScheduleConfig, step: int) -> int | float:
    """The difficulty a fixed schedule gives at optimizer step ``step`` (pure; ``custom``
    has no formula and raises ValueError)."""
    if schedule.schedule_type == "fixed_discrete":
        return _discrete_difficulty(schedule, step)
    if schedule.schedule_type == "fixed_linear":
        return _root_difficulty(schedule, step, 1)
    if schedule.schedule_type == "fixed_root":
        return _root_difficulty(schedule, step, schedule.root_degree)
    raise ValueError(f"schedule_type {schedule.schedule_type!r} has no fixed formula")


class CurriculumScheduler:
    """DeepSpeed's curriculum scheduler, built from a curriculum config dict
    (``min_difficulty``, ``max_difficulty``, ``schedule_type``, ``schedule_config``).

    ``update_difficulty(step)`` moves the current difficulty to the schedule's value at
    ``step`` until it has reached ``max_difficulty``; the engine calls it before each
    training forward with ``global_steps + 1``. ``get_state`` / ``set_state`` are the
    checkpointed state (DeepSpeed's names and keys).

    Raises:
        ConfigError: a missing key, an unknown schedule type, ``min_difficulty`` above
            ``max_difficulty``, or fixed_discrete values that are not increasing.
    """

    def __init__(self, config: Mapping, *, name: str = "curriculum_learning"):
        self.schedule = curriculum_schedule_config(name, config)
        """The validated schedule."""
        self.state = {
            "min_difficulty": config["min_difficulty"],
            "max_difficulty": config["max_difficulty"],
            "current_difficulty": config["min_difficulty"],
            "schedule_type": self.schedule.schedule_type,
        }
        """DeepSpeed's state dict: the config's values and ``current_difficulty``."""
        if self.schedule.schedule_type != "custom":
            self.state["schedule_config"] = copy.deepcopy(dict(config["schedule_config"]))
        self.custom_get_difficulty: Callable[[int], int] | None = None
        """The ``custom`` schedule's function of the step (``set_custom_get_difficulty``)."""
        self._name = name

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        """Use ``schedule_function(global_steps) -> difficulty`` (schedule_type ``custom``)."""
        if not callable(schedule_function):
            raise TypeError(f"a custom curriculum schedule must be callable, got {schedule_function!r}")
        self.custom_get_difficulty = schedule_function

    def get_difficulty(self, global_steps: int) -> int | float:
        """The schedule's difficulty at ``global_steps`` (does not change the state)."""
        if self.schedule.schedule_type != "custom":
            return scheduled_difficulty(self.schedule, global_steps)
        if self.custom_get_difficulty is None:
            raise RuntimeError(
                f"{self._name}.schedule_type is 'custom' but no schedule function was given: call "
                "engine.set_custom_curriculum_learning_schedule(fn) (or the scheduler's "
                "set_custom_get_difficulty(fn)) before training"
            )
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> int | float:
        """Move the current difficulty to the schedule's value at ``global_steps``, unless it
        has reached ``max_difficulty`` already; returns the current difficulty."""
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]

    def get_current_difficulty(self) -> int | float:
        return self.state["current_difficulty"]

    def set_current_difficulty(self, difficulty: int | float) -> None:
        self.state["current_difficulty"] = difficulty

    def get_state(self) -> dict:
        """The state DeepSpeed's scheduler checkpoints (the live dict, as DeepSpeed's)."""
        return self.state

    def set_state(self, state: Mapping) -> None:
        """Restore ``get_state()``'s dict (a copy is kept)."""
        self.state = copy.deepcopy(dict(state))
