"""Run every stage's action list together on a clock: makespan, busy and idle time.

Each stage executes its list in order; an action starts when the stage has finished the
previous one and the actions it depends on have ended (plus ``comm`` for a message from
another stage). With fixed per-stage orders this list scheduling is exact, so the loop
only has to advance any stage whose next action's dependencies are known; when no stage
can advance and some are unfinished, the stages wait on each other (a deadlock).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.pipe._actions import (
    COMPUTE,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
    label,
    message_key,
)


class ScheduleDeadlock(RuntimeError):
    """The stages of a schedule wait on each other; the message names each stuck action."""


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Durations in arbitrary time units."""

    forward: float
    """One ``Forward`` of one chunk."""
    backward: float
    """One whole ``Backward``."""
    backward_input: float
    """One ``BackwardInput``."""
    backward_weight: float
    """One ``BackwardWeight``."""
    comm: float
    """From the end of a send to the end of its receive (at the earliest)."""

    def of(self, action: Action) -> float:
        """How long ``action`` occupies its stage (0 for waits, sends and launches)."""
        return {
            Forward: self.forward,
            Backward: self.backward,
            BackwardInput: self.backward_input,
            BackwardWeight: self.backward_weight,
        }.get(type(action), 0.0)


@dataclass(frozen=True)
class SimResult:
    """What ``simulate`` measured. ``str()`` draws the timeline."""

    makespan: float
    """Time from the first action's start to the last action's end."""
    busy: tuple[float, ...]
    """Compute time (forwards and backwards) per stage."""
    timeline: tuple[tuple[tuple[float, float, Action], ...], ...]
    """Per stage, ``(start, end, action)`` of every action in execution order."""

    @property
    def num_stages(self) -> int:
        return len(self.busy)

    @property
    def idle_fraction(self) -> float:
        """The bubble: ``1 - total busy / (num_stages * makespan)``."""
        if self.makespan == 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_stages * self.makespan)

    def __str__(self) -> str:
        return format_timeline(self)


def _input_grad_action(plan: set[Action], mb: int, chunk: int) -> Action:
    split = BackwardInput(mb, chunk)
    return split if split in plan else Backward(mb, chunk)


def _needs(action: Action, stage: int, plans: list[set[Action]], num_chunks: int) -> list[tuple[int, Action, bool]]:
    """``(stage, action, is_message)`` that must end before ``action`` can start on ``stage``."""
    p, plan = len(plans), plans[stage]
    if isinstance(action, Forward):
        mb, k = action.micro_batch, action.chunk
        if k == 0:
            return []
        if (k - 1) % p == stage:
            return [(stage, Forward(mb, k - 1), False)]
        return [(stage, RecvActivation(mb, k, (k - 1) % p), False)]
    if isinstance(action, INPUT_GRAD):
        mb, k = action.micro_batch, action.chunk
        needs = [(stage, Forward(mb, k), False)]
        if k == num_chunks - 1:
            return needs
        if (k + 1) % p == stage:
            return needs + [(stage, _input_grad_action(plan, mb, k + 1), False)]
        return needs + [(stage, RecvGrad(mb, k, (k + 1) % p), False)]
    if isinstance(action, BackwardWeight):
        return [(stage, BackwardInput(action.micro_batch, action.chunk), False)]
    if isinstance(action, SendActivation):
        return [(stage, Forward(action.micro_batch, action.chunk), False)]
    if isinstance(action, SendGrad):
        return [(stage, _input_grad_action(plan, action.micro_batch, action.chunk), False)]
    if isinstance(action, RecvActivation):
        return [(action.from_stage, SendActivation(action.micro_batch, action.chunk - 1, stage), True)]
    if isinstance(action, RecvGrad):
        return [(action.from_stage, SendGrad(action.micro_batch, action.chunk + 1, stage), True)]
    if isinstance(action, ReduceGrads):
        return [(stage, a, False) for a in plan if isinstance(a, WEIGHT_GRAD) and a.chunk == action.chunk]
    assert isinstance(action, OptimizerStep), action
    return [(stage, a, False) for a in plan if isinstance(a, ReduceGrads)]


def _check_plans(plans: Sequence[Sequence[Action]]) -> None:
    """Reject lists no runtime could execute, with the stage and action named."""
    p = len(plans)
    sends: Counter = Counter()
    recvs: Counter = Counter()
    for s, plan in enumerate(plans):
        action, times = Counter(plan).most_common(1)[0] if plan else (None, 0)
        if times > 1:
            raise ValueError(f"stage {s} runs {action} {times} times")
        reduced, stepped = set(), False
        for a in plan:
            chunk = getattr(a, "chunk", s)
            if chunk % p != s:
                raise ValueError(f"stage {s} runs {a}, but chunk {chunk} lives on stage {chunk % p}")
            if stepped and not isinstance(a, OptimizerStep):
                raise ValueError(f"stage {s} runs {a} after its OptimizerStep")
            if isinstance(a, WEIGHT_GRAD) and a.chunk in reduced:
                raise ValueError(f"stage {s} runs {a} after ReduceGrads(chunk={a.chunk})")
            reduced |= {a.chunk} if isinstance(a, ReduceGrads) else set()
            stepped = stepped or isinstance(a, OptimizerStep)
            key = message_key(a)
            if key is not None:
                peer = getattr(a, "to_stage", getattr(a, "from_stage", None))
                step = 1 if isinstance(a, (SendActivation, RecvGrad)) else -1
                owner = (a.chunk + step) % p
                if peer != owner:
                    raise ValueError(f"stage {s} runs {a}, but chunk {a.chunk + step} lives on stage {owner}")
                (sends if isinstance(a, (SendActivation, SendGrad)) else recvs)[key] += 1
    unmatched = sorted((sends - recvs) + (recvs - sends))
    if unmatched:
        raise ValueError(f"sends and receives do not match for {len(unmatched)} message(s), e.g. {unmatched[:3]}")


def _deadlock_message(plans, pos, ends, needs_of) -> str:
    lines = ["pipeline schedule deadlocks; stuck actions per stage:"]
    for s, plan in enumerate(plans):
        if pos[s] == len(plan):
            continue
        action = plan[pos[s]]
        missing = [(ds, da) for ds, da, _ in needs_of(action, s) if (ds, da) not in ends]
        waits = []
        for ds, da in missing:
            if da not in plans[ds]:
                waits.append(f"{da} on stage {ds} (never scheduled)")
            elif ds == s:
                waits.append(f"{da}, which comes later in stage {s}'s own list")
            else:
                waits.append(f"{da} on stage {ds} (stage {ds} is stuck at {plans[ds][pos[ds]]})")
        lines.append(f"  stage {s}: {action} waits for " + "; ".join(waits))
    return "\n".join(lines)


def simulate_plans(plans: Sequence[Sequence[Action]], *, costs: Costs | Sequence[Costs]) -> SimResult:
    """Simulate one batch of the per-stage action lists ``plans`` (index = stage id), with
    one ``Costs`` for every stage or one per stage (unequal stages)."""
    _check_plans(plans)
    per_stage = [costs] * len(plans) if isinstance(costs, Costs) else list(costs)
    if len(per_stage) != len(plans):
        raise ValueError(f"{len(per_stage)} stage costs for {len(plans)} stages")
    sets = [set(plan) for plan in plans]
    chunks = [a.chunk for plan in plans for a in plan if isinstance(a, COMPUTE)]
    num_chunks = max(chunks, default=-1) + 1

    def needs_of(action: Action, stage: int) -> list[tuple[int, Action, bool]]:
        return _needs(action, stage, sets, num_chunks)

    p = len(plans)
    pos, free, busy = [0] * p, [0.0] * p, [0.0] * p
    ends: dict[tuple[int, Action], float] = {}
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(p)]
    advanced = True
    while advanced:
        advanced = False
        for s in range(p):
            while pos[s] < len(plans[s]):
                action = plans[s][pos[s]]
                needs = needs_of(action, s)
                if any((ds, da) not in ends for ds, da, _ in needs):
                    break
                start = max(
                    [free[s]] + [ends[(ds, da)] + (per_stage[ds].comm if msg else 0.0) for ds, da, msg in needs]
                )
                end = start + per_stage[s].of(action)
                ends[(s, action)] = free[s] = end
                busy[s] += end - start if isinstance(action, COMPUTE) else 0.0
                timeline[s].append((start, end, action))
                pos[s] += 1
                advanced = True
    if any(pos[s] < len(plans[s]) for s in range(p)):
        raise ScheduleDeadlock(_deadlock_message(plans, pos, ends, needs_of))
    return SimResult(
        makespan=max(free, default=0.0),
        busy=tuple(busy),
        timeline=tuple(tuple(row) for row in timeline),
    )


def format_timeline(result: SimResult) -> str:
    """An ASCII Gantt chart: one row per stage, one column per time unit, ``.`` = idle.

    The time unit is the shortest compute duration; an action spanning several units
    shows its label then ``-``. Labels as in ``format_schedule``.
    """
    compute = [(s, t0, t1, a) for s, row in enumerate(result.timeline) for t0, t1, a in row if isinstance(a, COMPUTE)]
    if not compute:
        return "(no compute actions)"
    unit = min((t1 - t0 for _, t0, t1, _ in compute if t1 > t0), default=1.0)
    show_chunk = len({(s, a.chunk) for s, _, _, a in compute}) > len({s for s, *_ in compute})
    width = max(len(label(a, show_chunk=show_chunk)) for *_, a in compute) + 1
    cells = math.ceil(result.makespan / unit - 1e-9)
    grid = [["." * (width - 1) + " "] * cells for _ in range(result.num_stages)]
    for s, t0, t1, a in compute:
        first, span = round(t0 / unit), max(1, round((t1 - t0) / unit))
        text = label(a, show_chunk=show_chunk).ljust(span * width - 1, "-") + " "
        for i in range(span):
            if first + i < cells:
                grid[s][first + i] = text[i * width : (i + 1) * width]
    lines = [f"stage {s} | " + "".join(row).rstrip() for s, row in enumerate(grid)]
    lines.append(f"makespan {result.makespan:g}, idle fraction {result.idle_fraction:.3f}")
    return "\n".join(lines)
