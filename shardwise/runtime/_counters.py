"""The engine's step counters, one declared dataclass the engine owns and a checkpoint
saves and restores through ``state_dict`` / ``load_state_dict``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class StepCounters:
    """How far training has come (DeepSpeed's engine attributes of the same names)."""

    global_steps: int = 0
    """Optimizer steps taken, skipped fp16 steps included."""
    global_samples: int = 0
    """Samples consumed over all data-parallel ranks."""
    micro_steps: int = 0
    """Calls of ``engine.step()`` (micro-batches)."""
    skipped_steps: int = 0
    """Optimizer steps skipped for an fp16 overflow."""

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Set every counter from ``state`` (all four keys required)."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, int(state[field.name]))


def counter(name: str) -> property:
    """An engine attribute that reads and writes ``engine.counters.<name>`` (so scripts and
    the engine keep using ``engine.global_steps`` and the like)."""
    return property(
        lambda self: getattr(self.counters, name),
        lambda self, value: setattr(self.counters, name, value),
        doc=f"``counters.{name}`` (see ``StepCounters``).",
    )
