"""DeepSpeed's learning-rate schedules: same class names, parameters, defaults and curves.

A schedule sets every param group's ``lr`` as a function of ``last_batch_iteration``
(the number of optimizer steps taken minus one; -1 before the first). Constructing one
writes the lr of iteration -1 (the schedule's starting lr) into the optimizer, so the
first optimizer step already follows the schedule; the engine calls ``step()`` after
every applied optimizer step. As in DeepSpeed, the warm-up schedules give their
starting lr to both of the first two steps. ``state_dict()`` is plain JSON data.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math

logger = logging.getLogger("shardwise")

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"


def _per_group(optimizer, value, name: str) -> list[float]:
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name} has {len(value)} values but the optimizer has {groups} param groups")
        return [float(v) for v in value]
    return [float(value)] * groups


def _warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warm-up done at ``iteration`` (log or linear ramp, 1 after it)."""
    if iteration < 0:
        return 0.0
    if iteration >= warmup_num_steps:
        return 1.0
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class _Schedule:
    """Shared mechanics: applying lrs (and momenta), stepping, state."""

    def __init__(self, optimizer, last_batch_iteration: int):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._apply(last_batch_iteration)

    def _lr_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def _momentum_at(self, iteration: int) -> list[float] | None:
        return None

    def _apply(self, iteration: int) -> None:
        lrs = self._lr_at(iteration)
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        momenta = self._momentum_at(iteration)
        if momenta is not None:
            for group, mom in zip(self.optimizer.param_groups, momenta):
                if "betas" in group:
                    group["betas"] = (mom, group["betas"][1])
                elif "momentum" in group:
                    group["momentum"] = mom
        self._last_lr = lrs

    def get_lr(self) -> list[float]:
        """The lrs of the current iteration."""
        return self._lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The lrs most recently written into the optimizer."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to the next iteration (or jump to ``last_batch_iteration``)."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(last_batch_iteration)

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply(self.last_batch_iteration)


class WarmupLR(_Schedule):
    """Ramp each group's lr from ``warmup_min_lr`` to ``warmup_max_lr`` over
    ``warmup_num_steps`` (logarithmically by default, or linearly), then hold it."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)

    def _lr_at(self, iteration: int) -> list[float]:
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay from ``warmup_max_lr`` to 0 at ``total_num_steps``."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        self.total_num_steps = int(total_num_steps)
        if self.total_num_steps < warmup_num_steps:
            logger.warning("WarmupDecayLR: total_num_steps %d is below warmup_num_steps %d",
                           self.total_num_steps, warmup_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - iteration)
                   / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Ramp from ``warmup_min_ratio`` x the optimizer's lr to the full lr over
    ``warmup_num_steps``, then follow a cosine down to ``cos_min_ratio`` x lr at
    ``total_num_steps``."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.warmup_type = warmup_type
        if self.total_num_steps < self.warmup_num_steps:
            raise ValueError(f"WarmupCosineLR: total_num_steps ({total_num_steps}) must be >= "
                             f"warmup_num_steps ({warmup_num_steps})")
        self.org_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, self.org_lrs):
            group.setdefault("initial_lr", lr)
        super().__init__(optimizer, last_batch_iteration)

    def _ratio(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            gamma = _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        progress = (iteration - self.warmup_num_steps) / max(1, self.total_num_steps - self.warmup_num_steps)
        cosine = (1 + math.cos(math.pi * min(progress, 1.0))) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lr_at(self, iteration: int) -> list[float]:
        ratio = self._ratio(iteration)
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """The 1-cycle policy: lr rises from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and falls back over ``cycle_second_step_size``
    (momentum moves the opposite way), then decays by ``decay_lr_rate`` every
    ``decay_step_size`` steps."""

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_second_stair_count if cycle_second_stair_count is not None \
            else cycle_first_stair_count
        self.decay_lr_rate, self.decay_step_size = float(decay_lr_rate), int(decay_step_size)
        self.cycle_momentum = cycle_momentum
        self.min_moms = [float(cycle_min_mom)] * len(optimizer.param_groups)
        self.max_moms = [float(cycle_max_mom)] * len(optimizer.param_groups)
        self.decay_mom_rate = float(decay_mom_rate)
        super().__init__(optimizer, last_batch_iteration)

    def _scale(self, iteration: int) -> float:
        position = (iteration + 1) / self.total_size
        x = 1.0 + position - math.floor(1 + position)
        if x <= self.step_ratio:
            return x / self.step_ratio
        return (x - 1) / (self.step_ratio - 1)

    def _decay_interval(self, iteration: int) -> float:
        if not self.decay_step_size:
            return 0.0
        return (iteration - self.total_size + 1) / self.decay_step_size

    def _lr_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        factor = 1 + self.decay_lr_rate * self._decay_interval(iteration)
        return [lo / factor for lo in self.min_lrs]

    def _momentum_at(self, iteration: int) -> list[float] | None:
        if not self.cycle_momentum:
            return None
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        factor = 1 + self.decay_mom_rate * self._decay_interval(iteration)
        return [hi * factor for hi in self.max_moms]


class LRRangeTest(_Schedule):
    """Grow the lr from ``lr_range_test_min_lr`` by ``lr_range_test_step_rate`` every
    ``lr_range_test_step_size`` steps (continuously, or in stairs) to find a good lr."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
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


def build_lr_scheduler(config, optimizer):
    """The schedule ``config.type`` names over ``optimizer``, with ``config.params``.

    Raises:
        ValueError: an unknown schedule or parameter name (with the closest match), or a
            required parameter missing.
    """
    cls = SCHEDULES.get(config.type)
    if cls is None:
        raise ValueError(f"unknown scheduler {config.type!r}; available: {', '.join(SCHEDULES)}")
    signature = inspect.signature(cls.__init__)
    allowed = [n for n in signature.parameters if n not in ("self", "optimizer", "last_batch_iteration")]
    params = {k: v for k, v in dict(config.params).items() if v != "auto"}
    for key in params:
        if key not in allowed:
            match = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean '{match[0]}'?" if match else f"; allowed: {', '.join(allowed)}"
            raise ValueError(f"scheduler.params.{key} is not a parameter of {config.type}{hint}")
    required = [n for n in allowed if signature.parameters[n].default is inspect.Parameter.empty]
    missing = [n for n in required if n not in params]
    if missing:
        raise ValueError(f"scheduler {config.type} needs scheduler.params.{missing[0]}")
    return cls(optimizer, **params)
