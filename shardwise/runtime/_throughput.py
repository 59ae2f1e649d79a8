"""DeepSpeed's ``engine.tput_timer`` (``deepspeed.utils.timer.ThroughputTimer``) as training
scripts use it: DeepSpeed-Chat's steps call ``update_epoch_count()`` after every epoch."""

from __future__ import annotations

import time


class ThroughputTimer:
    """Epoch, micro-step and optimizer-step counts and the mean training throughput.

    Read from the engine's counters (``micro_steps``, ``global_steps``,
    ``global_samples``) rather than timed around each forward: ``start()`` and ``stop()``
    are accepted and do nothing. ``avg_samples_per_sec()`` is the samples of every rank
    per second of wall-clock time since this timer was first read (DeepSpeed's excludes
    its first two steps and the time between a step and the next forward); before the
    first optimizer step it is ``-inf``, as in DeepSpeed.
    """

    def __init__(self, engine) -> None:
        self._engine = engine
        self.epoch_count = 0
        """Epochs ended (``update_epoch_count`` calls)."""
        self._epoch_start = engine.micro_steps
        self._since = (time.perf_counter(), engine.global_samples, engine.global_steps)

    @property
    def micro_step_count(self) -> int:
        """Micro-steps (``engine.step()`` calls) in the current epoch."""
        return self._engine.micro_steps - self._epoch_start

    @property
    def global_step_count(self) -> int:
        """Optimizer steps taken (``engine.global_steps``)."""
        return self._engine.global_steps

    def update_epoch_count(self) -> None:
        """An epoch ended: count it and start counting micro-steps again."""
        self.epoch_count += 1
        self._epoch_start = self._engine.micro_steps

    def start(self) -> None:
        """Accepted for DeepSpeed compatibility: the engine's counters are the clock."""

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """Accepted for DeepSpeed compatibility: the engine's counters are the clock."""
        del global_step, report_speed

    def avg_samples_per_sec(self) -> float:
        """Samples per second since this timer was first read (``-inf`` with no step yet)."""
        since, samples, steps = self._since
        if self._engine.global_steps == steps:
            return float("-inf")
        return (self._engine.global_samples - samples) / max(time.perf_counter() - since, 1e-9)
