"""Pipeline schedules as data: pure functions from (stages, micro-batches, stage) to actions.

A schedule tells one stage what to do during one batch, in order: forwards and backwards
of (micro-batch, chunk) pairs, the point-to-point transfers between stages, the
data-parallel gradient reduction and the optimizer step. It is plain data (printable,
comparable, testable without processes); one runtime executes any schedule, and
``simulate`` runs every stage's list together to measure the idle (bubble) time.

Vocabulary (``shardwise/pipe/_actions.py``): ``Forward``, ``Backward`` (input and weight
gradients together), ``BackwardInput`` / ``BackwardWeight`` (split backward),
``SendActivation`` / ``RecvActivation``, ``SendGrad`` / ``RecvGrad``, ``ReduceGrads``,
``OptimizerStep``. Chunk indices are global virtual-stage ids; see
[Note: pipeline chunks] in ``_actions.py``.

[Note: schedule layout]
Every training schedule is built in two steps: the order of compute actions (what
distinguishes the schedules), then ``_place_comm_and_step``, shared by all, which
- puts each receive immediately before the compute action that consumes it (the latest
  point; a runtime may post the receive earlier) and each send immediately after the
  compute that produces it (sends are non-blocking);
- puts ``ReduceGrads(chunk)`` right after the chunk's last weight-gradient action (after
  that action's ``SendGrad``, which the previous stage is waiting for), so the reduction
  of a chunk that finishes early (interleaved schedules, where the highest chunk's
  backward ends first) overlaps the remaining backward work, and the reduction of a
  stage's only chunk overlaps the previous stages' last backwards;
- ends with one ``OptimizerStep``, which waits for every reduction of the stage.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable, Sequence

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
from shardwise.pipe._simulate import Costs, ScheduleDeadlock, SimResult, simulate_plans

__all__ = [
    "Action",
    "Backward",
    "BackwardInput",
    "BackwardWeight",
    "Forward",
    "OptimizerStep",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "SCHEDULES",
    "ScheduleDeadlock",
    "SendActivation",
    "SendGrad",
    "SimResult",
    "build_schedule",
    "chunks_of_stage",
    "eval_schedule",
    "format_schedule",
    "gpipe",
    "interleaved_1f1b",
    "message_key",
    "one_f_one_b",
    "one_f_one_b_split",
    "peak_in_flight",
    "simulate",
    "zero_bubble",
]

Schedule = Callable[..., list[Action]]


def chunks_of_stage(num_stages: int, stage_id: int, *, virtual_stages: int = 1) -> tuple[int, ...]:
    """Global chunk ids held by ``stage_id``: ``stage_id + i * num_stages`` for each virtual stage."""
    return tuple(stage_id + i * num_stages for i in range(virtual_stages))


def _check_args(num_stages: int, num_micro_batches: int, stage_id: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    if not 0 <= stage_id < num_stages:
        raise ValueError(f"stage_id must be in [0, {num_stages}), got {stage_id}")


def _place_comm(compute: Sequence[Action], num_stages: int, stage_id: int, num_chunks: int) -> list[Action]:
    """Wrap each compute action with the receive it needs and the send it feeds."""
    out: list[Action] = []
    for action in compute:
        mb, k = action.micro_batch, action.chunk
        prev_stage, next_stage = (k - 1) % num_stages, (k + 1) % num_stages
        has_prev = k > 0 and prev_stage != stage_id
        has_next = k < num_chunks - 1 and next_stage != stage_id
        if isinstance(action, Forward):
            out += [RecvActivation(mb, k, prev_stage)] if has_prev else []
            out.append(action)
            out += [SendActivation(mb, k, next_stage)] if has_next else []
        elif isinstance(action, INPUT_GRAD):
            out += [RecvGrad(mb, k, next_stage)] if has_next else []
            out.append(action)
            out += [SendGrad(mb, k, prev_stage)] if has_prev else []
        else:
            out.append(action)
    return out


def _place_comm_and_step(compute: Sequence[Action], num_stages: int, stage_id: int, num_chunks: int) -> list[Action]:
    """Communication, one ``ReduceGrads`` per chunk and the ``OptimizerStep``; see [Note: schedule layout]."""
    out = _place_comm(compute, num_stages, stage_id, num_chunks)
    last_grad = {a.chunk: i for i, a in enumerate(out) if isinstance(a, WEIGHT_GRAD)}
    for chunk, i in sorted(last_grad.items(), key=lambda item: -item[1]):
        at = i + 1
        if at < len(out) and isinstance(out[at], SendGrad) and out[at].chunk == chunk:
            at += 1
        out.insert(at, ReduceGrads(chunk))
    out.append(OptimizerStep())
    return out


def one_f_one_b(num_stages: int, num_micro_batches: int, stage_id: int) -> list[Action]:
    """DeepSpeed's 1F1B (``TrainSchedule``): warm-up forwards, one-forward-one-backward, cool-down.

    Stage ``s`` runs ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and
    one (whole) backward, then finishes the remaining backwards. The compute order equals
    DeepSpeed's; a stage holds the activations of at most ``p - s`` micro-batches. With
    backward = 2 x forward and free communication the idle fraction is ``(p-1)/(m+p-1)``.
    """
    _check_args(num_stages, num_micro_batches, stage_id)
    m, s = num_micro_batches, stage_id
    warmup = min(num_stages - s - 1, m)
    order: list[Action] = [Forward(i, s) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Forward(warmup + i, s), Backward(i, s)]
    order += [Backward(i, s) for i in range(m - warmup, m)]
    return _place_comm_and_step(order, num_stages, s, num_stages)


def one_f_one_b_split(num_stages: int, num_micro_batches: int, stage_id: int) -> list[Action]:
    """1F1B with the drain's backwards split: for the cheapest part of zero-bubble's gain.

    1F1B's compute order, but stage ``s`` runs the backwards of its last ``p - s``
    micro-batches (its cool-down, and the one before it) as ``BackwardInput``, then at once
    ``BackwardWeight``. The input gradient leaves for the previous stage a weight half
    earlier at each stage of the drain, and this stage computes its weight half while the
    previous one works. The split costs something where the weight half is slower on its
    own (on a CPU, 15-25 % of a backward: see [Note: split backward]); this schedule pays
    it ``p - s`` times per batch instead of zero-bubble's ``m`` times, and holds what 1F1B
    holds (``p - s`` micro-batches) since no weight half waits. With forward = input half =
    weight half the bubble shrinks from ``(p-1)/(m+p-1)`` of 1F1B by one weight half per
    stage of the drain (the stages' last gradient arrives ``p - 1`` weight halves sooner).
    """
    _check_args(num_stages, num_micro_batches, stage_id)
    m, s = num_micro_batches, stage_id
    warmup = min(num_stages - s - 1, m)
    split_from = m - (num_stages - s)
    order: list[Action] = [Forward(i, s) for i in range(warmup)]

    def backward(i: int) -> None:
        order.extend([BackwardInput(i, s), BackwardWeight(i, s)] if i >= split_from else [Backward(i, s)])

    for i in range(m - warmup):
        order.append(Forward(warmup + i, s))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    return _place_comm_and_step(order, num_stages, s, num_stages)


def gpipe(num_stages: int, num_micro_batches: int, stage_id: int) -> list[Action]:
    """GPipe: every forward, then every backward (in micro-batch order).

    The same idle fraction as 1F1B but a stage holds all ``m`` micro-batches' activations;
    a simple baseline for tests.
    """
    _check_args(num_stages, num_micro_batches, stage_id)
    m, s = num_micro_batches, stage_id
    order: list[Action] = [Forward(i, s) for i in range(m)] + [Backward(i, s) for i in range(m)]
    return _place_comm_and_step(order, num_stages, s, num_stages)


def interleaved_1f1b(
    num_stages: int, num_micro_batches: int, stage_id: int, *, virtual_stages: int = 2
) -> list[Action]:
    """Megatron's interleaved 1F1B: each stage holds ``virtual_stages`` chunks of the model.

    Micro-batches go through a stage's chunks in rounds of ``p`` micro-batches: forwards of
    round ``r`` run chunk ``s``, then ``s + p``, ..., each for micro-batches
    ``r*p .. r*p + p - 1``; backwards visit the chunks in the reverse order. Stage ``s``
    runs ``(v - 1) * p + 2 * (p - s - 1)`` warm-up forwards (capped at ``m * v``), then one
    forward and one backward alternately. The idle time is about ``1/v`` of 1F1B's
    (``(p-1)/(v*m+p-1)`` with backward = 2 x forward), for ``v`` times as many transfers
    and up to ``(v - 1) * p + 2 * (p - s - 1) + 1`` micro-batch-chunks of activations held.

    Args:
        virtual_stages: chunks per stage (``v``). The model must be cut into ``p * v``
            pieces. ``num_micro_batches`` must be a multiple of ``num_stages``.
    """
    _check_args(num_stages, num_micro_batches, stage_id)
    p, m, s, v = num_stages, num_micro_batches, stage_id, virtual_stages
    if v < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {v}")
    if m % p:
        raise ValueError(
            f"the interleaved schedule needs num_micro_batches to be a multiple of num_stages "
            f"({p}), got {m}; use {m + p - m % p} micro-batches or the '1f1b' schedule"
        )

    def slot(k: int, backward: bool) -> tuple[int, int]:
        local = (k // p) % v
        local = v - 1 - local if backward else local
        return (k // (p * v)) * p + k % p, local * p + s

    total = m * v
    warmup = min((v - 1) * p + 2 * (p - s - 1), total)
    order: list[Action] = [Forward(*slot(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [Forward(*slot(warmup + k, False)), Backward(*slot(k, True))]
    order += [Backward(*slot(k, True)) for k in range(total - warmup, total)]
    return _place_comm_and_step(order, p, s, p * v)


def zero_bubble(num_stages: int, num_micro_batches: int, stage_id: int) -> list[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with a split backward.

    The backward is split into ``BackwardInput`` (what the previous stage waits for) and
    ``BackwardWeight`` (free to move). Stage ``s`` keeps 1F1B's forward and input-backward
    order but runs each micro-batch's weight backward only ``s`` input-backwards later;
    the ``s`` postponed weight backwards fill the cool-down bubble. Input gradients reach
    earlier stages sooner, so with forward = input-backward = weight-backward the idle
    time is a third of 1F1B's. Every stage holds (some) activations of at most ``p``
    micro-batches: 1F1B's peak on stage 0, more than 1F1B on later stages.
    """
    _check_args(num_stages, num_micro_batches, stage_id)
    m, s = num_micro_batches, stage_id
    warmup = min(num_stages - s - 1, m)
    order: list[Action] = [Forward(i, s) for i in range(warmup)]
    pending: deque[int] = deque()

    def backward(i: int) -> None:
        order.append(BackwardInput(i, s))
        pending.append(i)
        if len(pending) > s:
            order.append(BackwardWeight(pending.popleft(), s))

    for i in range(m - warmup):
        order.append(Forward(warmup + i, s))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    order += [BackwardWeight(i, s) for i in pending]
    return _place_comm_and_step(order, num_stages, s, num_stages)


def eval_schedule(num_stages: int, num_micro_batches: int, stage_id: int, *, virtual_stages: int = 1) -> list[Action]:
    """Forwards only (``eval_batch``): no backward, reduction or optimizer step.

    With ``virtual_stages > 1`` micro-batches go through the stage's chunks in rounds of
    ``num_stages`` (as in ``interleaved_1f1b``); any number of micro-batches is allowed.
    """
    _check_args(num_stages, num_micro_batches, stage_id)
    p, m, s, v = num_stages, num_micro_batches, stage_id, virtual_stages
    if v < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {v}")
    order: list[Action] = [
        Forward(first + i, c * p + s) for first in range(0, m, p) for c in range(v) for i in range(min(p, m - first))
    ]
    return _place_comm(order, p, s, p * v)


SCHEDULES: dict[str, Schedule] = {
    "1f1b": one_f_one_b,
    "1f1b_split": one_f_one_b_split,
    "interleaved": interleaved_1f1b,
    "zero_bubble": zero_bubble,
    "gpipe": gpipe,
}
"""Training schedules by the name the ``pipeline.schedule`` config uses."""


EVAL = "eval"
"""``build_schedule``'s name for ``eval_schedule`` (not a training schedule choice)."""


def _resolve(schedule: str | Schedule) -> Schedule:
    if callable(schedule):
        return schedule
    if schedule == EVAL:
        return eval_schedule
    if schedule not in SCHEDULES:
        raise ValueError(
            f"unknown pipeline schedule {schedule!r}; allowed: {', '.join(sorted(SCHEDULES))} "
            f"(or {EVAL!r} for forwards only)"
        )
    return SCHEDULES[schedule]


def build_schedule(name: str, num_stages: int, num_micro_batches: int, stage_id: int, **options) -> list[Action]:
    """The action list of schedule ``name`` (a key of ``SCHEDULES``, or ``"eval"``) for one stage.

    Raises ``ValueError`` for an unknown name or an option the schedule does not take
    (e.g. ``virtual_stages`` for ``"1f1b"``), naming what is allowed.
    """
    fn = _resolve(name)
    accepted = [n for n, prm in inspect.signature(fn).parameters.items() if prm.kind is prm.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        allowed = ", ".join(accepted) or "none"
        raise ValueError(f"pipeline schedule {name!r} takes no option {', '.join(unknown)} (options: {allowed})")
    return fn(num_stages, num_micro_batches, stage_id, **options)


def simulate(
    schedule: str | Schedule,
    num_stages: int,
    num_micro_batches: int,
    *,
    t_forward: float | Sequence[float] = 1.0,
    t_backward_input: float | Sequence[float] = 1.0,
    t_backward_weight: float | Sequence[float] = 1.0,
    t_backward: float | Sequence[float] | None = None,
    t_comm: float | Sequence[float] = 0.0,
    **options,
) -> SimResult:
    """Run every stage's action list together and measure makespan and idle time.

    An action starts when its stage has finished the previous action and its inputs are
    ready: a receive ends ``t_comm`` after the matching send (sends take no stage time),
    a forward needs its input, a backward its forward and its output gradient, a weight
    backward its input backward, ``ReduceGrads`` the chunk's weight gradients,
    ``OptimizerStep`` every reduction. Reductions and the step take no time.

    Durations are per action, i.e. per chunk: to compare makespans of an interleaved
    schedule (``v`` chunks per stage) with 1F1B, divide its durations by ``v``. The idle
    fraction does not depend on that scale. Every duration is one number for all stages
    or a sequence with one per stage (stages of unequal cost; ``t_comm`` then belongs to
    the sending stage).

    Args:
        schedule: a name from ``SCHEDULES``, ``"eval"``, or a schedule function.
        t_backward: duration of a whole ``Backward``; defaults to
            ``t_backward_input + t_backward_weight`` so split and whole backwards compare.
        options: passed to the schedule (e.g. ``virtual_stages=2``).

    Raises:
        ScheduleDeadlock: the stages wait on each other; the message lists each stage's
            stuck action and what it waits for.
    """
    fn = _resolve(schedule)
    plans = [fn(num_stages, num_micro_batches, s, **options) for s in range(num_stages)]

    def at(value, stage: int) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        if len(value) != num_stages:
            raise ValueError(f"per-stage durations need one value per stage ({num_stages}), got {list(value)}")
        return float(value[stage])

    costs = []
    for s in range(num_stages):
        whole = at(t_backward_input, s) + at(t_backward_weight, s) if t_backward is None else at(t_backward, s)
        costs.append(
            Costs(
                forward=at(t_forward, s),
                backward=whole,
                backward_input=at(t_backward_input, s),
                backward_weight=at(t_backward_weight, s),
                comm=at(t_comm, s),
            )
        )
    return simulate_plans(plans, costs=costs)


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most (micro-batch, chunk) pairs whose activations one stage holds at once.

    A pair is held from its ``Forward`` until its ``Backward`` or ``BackwardWeight``
    (after ``BackwardInput`` only part of the activations remains, counted as held).
    """
    held = peak = 0
    for action in actions:
        if isinstance(action, Forward):
            held += 1
            peak = max(peak, held)
        elif isinstance(action, WEIGHT_GRAD):
            held -= 1
    return peak


def format_schedule(plans: Sequence[Action] | Sequence[Sequence[Action]], *, comm: bool = False) -> str:
    """One row per stage listing its actions in execution order (not time; see ``SimResult``).

    Labels: ``F3`` forward of micro-batch 3, ``B3`` whole backward, ``BI3``/``BW3`` input/
    weight backward, ``R`` reduce, ``S`` optimizer step; with ``comm=True`` also
    ``ra``/``sa``/``rg``/``sg`` (receive/send activation/grad). Chunks are shown
    (``F3c5``) when a stage holds more than one. A single stage's list prints as one row.
    """
    rows = [plans] if plans and not isinstance(plans[0], Sequence) else plans
    show_chunk = any(len({a.chunk for a in row if isinstance(a, COMPUTE)}) > 1 for row in rows)
    lines = []
    for s, row in enumerate(rows):
        shown = [a for a in row if comm or message_key(a) is None]
        lines.append(f"stage {s}: " + " ".join(label(a, show_chunk=show_chunk) for a in shown))
    return "\n".join(lines)
