"""Stage boundaries: cutting a list of layer weights into contiguous pipeline stages.

Pure functions (no processes, no layers): ``PipelineModule`` turns its
``partition_method`` into one weight per layer (parameter counts, matching layer types,
or measured seconds; see ``_profile.py``) and calls one of these.

[Note: two balancing objectives]
DeepSpeed's ``"parameters"`` and ``"type:"`` methods cut so that the stages' weights are
as *even* as possible: the spread (heaviest stage minus lightest) is minimised, stage by
stage, by a dynamic programme whose ties go to the latest cut. ``partition_balanced``
reproduces that result exactly (same boundaries as DeepSpeed 0.19.8, so a model is split,
named and checkpointed the same way in both). A step's time, though, is set by the
*slowest* stage, and the most even split is not always the one with the lightest
heaviest stage: ``[3, 1, 4, 1, 5, 9, 2, 6]`` in 3 gives DeepSpeed's ``14 | 9 | 8`` where
``14 | 11 | 6`` is as good, but ``[6, 1, 1, 6]`` in 2 can only be ``7 | 7``. For measured
costs (``"profile"``) ``partition_min_max`` minimises the heaviest stage, exactly, and
among the cuts that do, the spread.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from shardwise.pipe._errors import PipelineError

__all__ = ["partition_balanced", "partition_min_max", "partition_uniform"]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries ``[0, ..., num_items]`` cutting ``num_items`` into ``num_parts`` runs
    whose lengths differ by at most one (longer runs first, as DeepSpeed's)."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return bounds


def _check(weights: Sequence[float], num_parts: int) -> None:
    if len(weights) < num_parts:
        raise PipelineError(
            f"{len(weights)} layer(s) cannot fill {num_parts} pipeline stages; give at least one layer per stage"
        )
    bad = [w for w in weights if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0)]
    if bad:
        raise PipelineError(f"layer weights must be finite non-negative numbers, got {bad[:3]}")


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's balanced partition: contiguous, non-empty runs whose weights are as even
    as possible (see [Note: two balancing objectives]); the boundaries DeepSpeed 0.19.8
    chooses for the same weights.

    For every prefix of ``i`` layers cut into ``j`` runs it keeps one cut: the one whose
    (heaviest - lightest) run is smallest, the latest such cut on a tie, and extends it.
    O(n^2 x parts).
    """
    _check(weights, num_parts)
    n = len(weights)
    prefix = list(itertools.accumulate(weights, initial=0))
    inf = math.inf
    # best[j][i]: (spread, heaviest, lightest) of the kept cut of the first i layers into j runs
    heaviest = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    lightest = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    spread = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    heaviest[0][0] = spread[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            for k in range(j - 1, i):  # the last run is layers k..i-1 (every run non-empty)
                run = prefix[i] - prefix[k]
                high, low = max(heaviest[j - 1][k], run), min(lightest[j - 1][k], run)
                if high - low <= spread[j][i]:
                    spread[j][i], heaviest[j][i], lightest[j][i], cut[j][i] = high - low, high, low, k
    return _walk_back(cut, n, num_parts)


def partition_min_max(costs: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous, non-empty runs minimising the heaviest run's cost (the slowest stage),
    exactly. Ties go towards an even split: each prefix keeps, among its cuts with the
    lightest heaviest run, the one with the smallest spread (heaviest - lightest), the
    earliest on a further tie. O(n^2 x parts)."""
    _check(costs, num_parts)
    n = len(costs)
    prefix = list(itertools.accumulate(costs, initial=0.0))
    inf = math.inf
    # key[j][i]: (heaviest, spread) of the best cut of the first i layers into j runs;
    # lightest[j][i] is that cut's lightest run
    key = [[(inf, inf)] * (n + 1) for _ in range(num_parts + 1)]
    lightest = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    key[0][0] = (0.0, 0.0)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            for k in range(j - 1, i):
                if key[j - 1][k][0] == inf:
                    continue
                run = prefix[i] - prefix[k]
                high, low = max(key[j - 1][k][0], run), min(lightest[j - 1][k], run)
                candidate = (high, high - low)
                if candidate < key[j][i]:
                    key[j][i], lightest[j][i], cut[j][i] = candidate, low, k
    return _walk_back(cut, n, num_parts)


def _walk_back(cut: list[list[int]], n: int, num_parts: int) -> list[int]:
    bounds = [n]
    for j in range(num_parts, 0, -1):
        bounds.append(cut[j][bounds[-1]])
    return bounds[::-1]
