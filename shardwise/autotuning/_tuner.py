"""The search: which candidate runs next, when to stop, which one won. Decisions only; the
experiments are run by the function the caller passes, so the search is tested as data.

[Note: autotuning search]
Experiments run one at a time. ``gridsearch`` takes the candidates in (stage, micro-batch,
offload) order; ``random`` in a seeded shuffle of that order; ``model_based`` first runs
the candidate a simple heuristic expects to be fastest (lowest stage, largest micro-batch,
no offload) and then, after each experiment, the untried candidate a least-squares cost
model predicts best (features: stage, log2 micro-batch, log2 accumulation, offload flags;
fitted to the measured experiments; DeepSpeed fits XGBoost here). The search stops after
``tuner_num_trials`` experiments, or after ``tuner_early_stopping`` experiments in a row
(failed ones included) that did not beat the best, or when no candidate is left. A
candidate the runner turns down (``run_one`` returns None: pruned once the first experiment
has counted the model's parameters) is dropped without counting. The best experiment has
the highest throughput, the lowest latency, or the highest flops (FLOP/s per rank).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from shardwise.autotuning._space import Candidate
from shardwise.config._autotuning import AutotuningConfig


class Status(enum.Enum):
    MEASURED = "measured"  # reached end_profile_step and wrote its metrics
    FAILED = "failed"  # exited with an error before writing metrics
    HUNG = "hung"  # still running at its deadline; its processes were killed
    NO_METRIC = "no metric"  # exited cleanly without reaching end_profile_step


@dataclass(frozen=True)
class Outcome:
    """What one experiment gave."""

    candidate: Candidate
    status: Status
    metrics: Mapping[str, float] = field(default_factory=dict)
    """The experiment's metrics file (``throughput``, ``latency``...) when measured."""
    error: str = ""
    """Why it gave no metrics (the tail of its error output, or the deadline)."""


def is_better(value: float, best: float | None, metric: str) -> bool:
    """Whether ``value`` of ``metric`` beats ``best`` (latency: lower is better;
    throughput and flops: higher)."""
    if best is None:
        return True
    return value < best if metric == "latency" else value > best


def best_outcome(outcomes: list[Outcome], metric: str) -> Outcome | None:
    """The measured outcome with the best ``metric``; None when nothing was measured."""
    best = None
    for outcome in outcomes:
        if outcome.status is Status.MEASURED and (
            best is None or is_better(outcome.metrics[metric], best.metrics[metric], metric)
        ):
            best = outcome
    return best


def _features(candidate: Candidate) -> list[float]:
    return [
        1.0,
        float(candidate.stage),
        math.log2(candidate.micro_batch),
        math.log2(candidate.gas),
        float(candidate.offload_optimizer),
        float(candidate.offload_param),
    ]


def _heuristic(candidate: Candidate) -> tuple:
    return (candidate.offload_optimizer or candidate.offload_param, candidate.stage, -candidate.micro_batch)


def predict(untried: list[Candidate], outcomes: list[Outcome], metric: str) -> Candidate:
    """The untried candidate the cost model fitted to ``outcomes`` predicts best (the
    heuristic's first choice while nothing is measured)."""
    measured = [o for o in outcomes if o.status is Status.MEASURED]
    if not measured:
        return min(untried, key=_heuristic)
    x = torch.tensor([_features(o.candidate) for o in measured], dtype=torch.float64)
    y = torch.tensor([[o.metrics[metric]] for o in measured], dtype=torch.float64)
    weights = torch.linalg.lstsq(x, y, driver="gelsd").solution
    scores = (torch.tensor([_features(c) for c in untried], dtype=torch.float64) @ weights).squeeze(1)
    index = int(scores.argmin() if metric == "latency" else scores.argmax())
    return untried[index]


def search(
    candidates: list[Candidate], tuning: AutotuningConfig, run_one: Callable[[Candidate], Outcome | None]
) -> list[Outcome]:
    """Run candidates with ``run_one`` in the order ``tuning.tuner_type`` gives, until a
    stopping rule holds (see [Note: autotuning search]); returns every outcome in run order."""
    untried = sorted(candidates)
    if tuning.tuner_type == "random":
        random.Random(0).shuffle(untried)
    outcomes: list[Outcome] = []
    best: float | None = None
    since_best = 0
    while untried and len(outcomes) < tuning.tuner_num_trials and since_best < tuning.tuner_early_stopping:
        if tuning.tuner_type == "model_based":
            candidate = predict(untried, outcomes, tuning.metric)
        else:
            candidate = untried[0]
        untried.remove(candidate)
        outcome = run_one(candidate)
        if outcome is None:
            continue
        outcomes.append(outcome)
        if outcome.status is Status.MEASURED and is_better(outcome.metrics[tuning.metric], best, tuning.metric):
            best, since_best = outcome.metrics[tuning.metric], 0
        else:
            since_best += 1
    return outcomes
