"""DeepSpeed's learning-rate schedules: same class names, parameters, defaults and curves.

A schedule sets every param group's ``lr`` as a function of ``last_batch_iteration``,
the number of optimizer steps taken minus one (-1 before the first). The engine calls
``step()`` after every applied optimizer step, so the lr used by optimizer step ``k``
(1-based) is the schedule's value at iteration ``k - 2``.

[Note: lr at construction]
Constructing a schedule writes the lr of ``last_batch_iteration`` into the optimizer, so
the first optimizer step already follows the schedule. At iteration -1 the values are
DeepSpeed's: ``warmup_min_lr`` (WarmupLR, WarmupDecayLR), 0 (WarmupCosineLR),
``cycle_min_lr`` with beta1 ``cycle_min_mom`` (OneCycle), ``lr_range_test_min_lr``
(LRRangeTest). The warm-ups start at their minimum again at iteration 0, so the first two
optimizer steps share it. DeepSpeed leaves the optimizer alone when constructed with
``last_batch_iteration >= 0`` and in ``load_state_dict``; writing the lr there too is
equivalent after a full checkpoint load and correct after a partial one.

``state_dict()`` is ``{"last_batch_iteration": n}``, the same as DeepSpeed's (plain JSON).
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("shardwise")

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
# OneCycle writes this beta2 with every beta1 it schedules, as DeepSpeed does.
_ONE_CYCLE_BETA2 = 0.99


def _per_group(optimizer, value, name: str) -> list[float]:
    """``value`` (a number, or one per param group) as one float per param group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name} has {len(value)} values but the optimizer has {groups} param groups")
        return [float(v) for v in value]
    return [float(value)] * groups


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _warmup_type(value: str) -> str:
    if value not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {value!r}")
    return value


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far a warm-up of ``warmup_num_steps`` (>= 2) is at ``iteration`` (0 <= it < steps).

    Log: ``log(it + 1) / log(steps)``, reaching 1 at the last warm-up iteration.
    Linear: ``it / steps``.
    """
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class _Schedule:
    """Shared mechanics: writing lrs (and beta1) into the optimizer, stepping, state."""

    def __init__(self, optimizer, last_batch_iteration: int):
        self.optimizer = optimizer
        self.last_batch_iteration = int(last_batch_iteration)
        self._last_lr: list[float] = []
        self._apply()  # See [Note: lr at construction]

    def _lr_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        lrs = self._lr_at(self.last_batch_iteration)
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = list(lrs)

    def get_lr(self) -> list[float]:
        """The lr of each param group at the current ``last_batch_iteration``."""
        return self._lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The lrs this schedule last wrote into the optimizer."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to ``last_batch_iteration``) and write its lrs.

        Args:
            last_batch_iteration: the iteration to move to; the next one when None.
        """
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = int(last_batch_iteration)
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """``{"last_batch_iteration": n}``: JSON data, the same as DeepSpeed's."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at ``state_dict["last_batch_iteration"]`` and write that iteration's lrs."""
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        self._apply()


class WarmupLR(_Schedule):
    """Warm each param group's lr up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold.

    ``lr(it) = min + (max - min) * f(it)`` with ``f`` the log (default) or linear warm-up
    fraction for ``it < warmup_num_steps`` and 1 afterwards; ``lr(-1) = min``.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` this sets.
        warmup_min_lr: starting lr, a number or one per param group.
        warmup_max_lr: lr after the warm-up, a number or one per param group; None takes
            the first param group's current lr (for every group, as DeepSpeed does).
        warmup_num_steps: iterations of the warm-up; values below 2 act as 2.
        warmup_type: ``"log"`` (fast start) or ``"linear"``.
        last_batch_iteration: iteration to start at; -1 for a fresh run.
    """

    def __init__(
        self,
        optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ):
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = _warmup_type(warmup_type)
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def _lr_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay from ``warmup_max_lr`` to 0 at ``total_num_steps``.

    After the warm-up, ``lr(it) = max * max(0, (total - it) / max(1, total - warmup))``.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` this sets.
        total_num_steps: the iteration at which the lr reaches 0 (and stays).
        warmup_min_lr: starting lr, a number or one per param group.
        warmup_max_lr: lr at the end of the warm-up, a number or one per param group.
        warmup_num_steps: iterations of the warm-up; values below 2 act as 2.
        warmup_type: ``"log"`` (fast start) or ``"linear"``.
        last_batch_iteration: iteration to start at; -1 for a fresh run.
    """

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d",
                self.total_num_steps,
                self.warmup_num_steps,
            )

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(_Schedule):
    """Scale each group's lr by a warm-up ratio, then by a cosine down to ``cos_min_ratio``.

    The base lrs are the optimizer's lrs at construction. During the warm-up the ratio
    rises from ``warmup_min_ratio`` to 1 (log or linear); afterwards it is
    ``cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2`` with
    ``p = min(1, (it - warmup + 1) / max(1, total - warmup))``, so it reaches
    ``cos_min_ratio`` at iteration ``total - 1`` and stays there. At iteration -1 the lr
    is 0 (DeepSpeed's value).

    Args:
        optimizer: the optimizer whose param groups' ``lr`` this scales.
        total_num_steps: iterations until the cosine reaches its floor.
        warmup_min_ratio: the ratio at the start of the warm-up.
        warmup_num_steps: iterations of the warm-up; values below 2 act as 2.
        cos_min_ratio: the floor ratio of the cosine.
        warmup_type: ``"log"`` (fast start) or ``"linear"``.
        last_batch_iteration: iteration to start at; -1 for a fresh run.
    """

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = _warmup_type(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupCosineLR: total_num_steps %d is less than warmup_num_steps %d",
                self.total_num_steps,
                self.warmup_num_steps,
            )
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def _ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            fraction = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * fraction
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lr_at(self, iteration: int) -> list[float]:
        ratio = self._ratio(iteration)
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """The 1-cycle policy (Smith, 2018): one triangle of lr (and inverse beta1), then decay.

    With ``x`` the position of iteration ``it + 1`` in the cycle of ``first + second``
    iterations, the lr rises linearly from ``cycle_min_lr`` to ``cycle_max_lr`` over the
    first ``cycle_first_step_size`` iterations and falls back over
    ``cycle_second_step_size``; a stair count > 0 quantises that half into as many flat
    steps. After the cycle the lr is ``cycle_min_lr / (1 + decay_lr_rate * n)`` with
    ``n = (it - cycle + 1) / decay_step_size`` (no decay when either is 0). When
    ``cycle_momentum`` is on, beta1 moves inversely between ``cycle_max_mom`` and
    ``cycle_min_mom`` and afterwards is ``cycle_max_mom * (1 + decay_mom_rate * n)``;
    beta2 is set to 0.99 as DeepSpeed does. Momentum cycling needs an optimizer with
    ``betas`` (Adam-like); with others (SGD) it is disabled with a warning, as in DeepSpeed.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` (and ``betas``) this sets.
        cycle_min_lr: lr at the cycle's ends, a number or one per param group.
        cycle_max_lr: lr at the cycle's peak, a number or one per param group.
        decay_lr_rate: lr decay rate after the cycle.
        cycle_first_step_size: iterations of the rising half.
        cycle_second_step_size: iterations of the falling half; None = the rising half's.
        cycle_first_stair_count: flat stairs in the rising half; 0 = continuous.
        cycle_second_stair_count: flat stairs in the falling half; None = the first's.
        decay_step_size: iterations per decay interval after the cycle; 0 = no decay.
        cycle_momentum: cycle beta1 inversely to the lr.
        cycle_min_mom: beta1 at the lr's peak, a number or one per param group.
        cycle_max_mom: beta1 at the cycle's ends, a number or one per param group.
        decay_mom_rate: beta1 growth rate after the cycle.
        last_batch_iteration: iteration to start at; -1 for a fresh run.
    """

    def __init__(
        self,
        optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ):
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = float(
            cycle_second_step_size if cycle_second_step_size is not None else cycle_first_step_size
        )
        if self.first_step_size <= 0 or self.second_step_size <= 0:
            raise ValueError(
                "cycle_first_step_size and cycle_second_step_size must be > 0, got "
                f"{cycle_first_step_size} and {cycle_second_step_size}"
            )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = int(cycle_first_stair_count)
        self.second_stair_count = int(
            cycle_second_stair_count if cycle_second_stair_count is not None else cycle_first_stair_count
        )
        self.decay_step_size = int(decay_step_size)
        self.decay_lr_rate = float(decay_lr_rate)
        self.decay_mom_rate = float(decay_mom_rate)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.cycle_momentum = bool(cycle_momentum) and self._has_betas(optimizer)
        super().__init__(optimizer, last_batch_iteration)

    @staticmethod
    def _has_betas(optimizer) -> bool:
        if "betas" in getattr(optimizer, "defaults", {}):
            betas2 = {g["betas"][1] for g in optimizer.param_groups}
            if betas2 != {_ONE_CYCLE_BETA2}:
                logger.warning(
                    "OneCycle sets beta2 to %s while cycling momentum, as DeepSpeed does (the optimizer had %s)",
                    _ONE_CYCLE_BETA2,
                    sorted(betas2),
                )
            return True
        logger.warning(
            "OneCycle: cycle_momentum is disabled because %s has no 'betas' "
            "(as in DeepSpeed, only beta1 of Adam-like optimizers is cycled)",
            type(optimizer).__name__,
        )
        return False

    def _scale(self, iteration: int) -> float:
        """Where in the triangle iteration ``iteration`` is: 0 at the ends, 1 at the peak."""
        position = (iteration + 1) % self.total_size
        if position <= self.first_step_size:
            offset, span, stairs = position, self.first_step_size, self.first_stair_count
        else:
            offset, span, stairs = self.total_size - position, self.second_step_size, self.second_stair_count
        if stairs > 0:
            # Quantise from the iteration offset, not from the float scale: at a half's
            # end the scale can land a hair under a whole stair and floor one too low.
            return math.floor(offset * stairs / span) / stairs
        return offset / span

    def _decay_intervals(self, iteration: int) -> float:
        return (iteration - self.total_size + 1) / self.decay_step_size

    def _lr_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_intervals(iteration)
        return [lo / factor for lo in self.min_lrs]

    def _mom_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_moms)  # DeepSpeed's value at construction
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_intervals(iteration)
        return [hi * factor for hi in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """``(beta1, beta2)`` of each param group now, or None without momentum cycling."""
        if not self.cycle_momentum:
            return None
        return [(m, _ONE_CYCLE_BETA2) for m in self._mom_at(self.last_batch_iteration)]

    def _apply(self) -> None:
        super()._apply()
        momenta = self.get_mom()
        if momenta is not None:
            for group, betas in zip(self.optimizer.param_groups, momenta):
                group["betas"] = betas


class LRRangeTest(_Schedule):
    """Grow the lr from ``lr_range_test_min_lr`` to find the largest one that still trains.

    ``lr(it) = min_lr * (1 + step_rate * (it + 1) / step_size)``, with the fraction
    floored when ``lr_range_test_staircase`` is set.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` this sets.
        lr_range_test_min_lr: starting lr, a number or one per param group.
        lr_range_test_step_size: iterations per growth interval.
        lr_range_test_step_rate: growth per interval, as a multiple of the starting lr.
        lr_range_test_staircase: grow in whole intervals instead of continuously.
        last_batch_iteration: iteration to start at; -1 for a fresh run.
    """

    def __init__(
        self,
        optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ):
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        if lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be > 0, got {lr_range_test_step_size}")
        self.step_size = float(lr_range_test_step_size)
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def _lr_at(self, iteration: int) -> list[float]:
        interval = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lrs]


SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}


VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
"""The schedule names a config's ``scheduler.type`` may take (DeepSpeed's list)."""


def build_lr_scheduler(config, optimizer):
    """The schedule ``config.type`` names over ``optimizer``, with ``config.params``.

    Values equal to ``"auto"`` count as absent, so the schedule's default applies. The
    optimizer's lrs are set at once; see [Note: lr at construction].

    Args:
        config: has ``type`` (a class name in ``SCHEDULES``) and ``params`` (a mapping of
            that class's constructor parameters, ``last_batch_iteration`` included).
        optimizer: the optimizer to schedule.

    Raises:
        ValueError: an unknown schedule or parameter name (naming the closest match), or
            a required parameter missing.
    """
    cls = SCHEDULES.get(config.type)
    if cls is None:
        match = difflib.get_close_matches(str(config.type), list(SCHEDULES), n=1)
        hint = f"; did you mean {match[0]!r}?" if match else ""
        raise ValueError(f"unknown scheduler {config.type!r}{hint} (known: {', '.join(SCHEDULES)})")
    signature = inspect.signature(cls.__init__)
    allowed = [n for n in signature.parameters if n not in ("self", "optimizer")]
    params = {k: v for k, v in dict(config.params or {}).items() if not (isinstance(v, str) and v == "auto")}
    for key in params:
        if key not in allowed:
            match = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean {match[0]!r}?" if match else ""
            raise ValueError(
                f"scheduler.params.{key} is not a parameter of {config.type}{hint} (allowed: {', '.join(allowed)})"
            )
    missing = [n for n in allowed if signature.parameters[n].default is inspect.Parameter.empty and n not in params]
    if missing:
        raise ValueError(f"scheduler {config.type} needs scheduler.params.{missing[0]}")
    return cls(optimizer, **params)
