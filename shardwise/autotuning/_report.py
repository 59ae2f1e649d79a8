"""The tuning run's result files in ``results_dir``, in DeepSpeed's layout, and the error
that lists what every configuration failed with when none could be measured.

``summary.txt``: DeepSpeed's pipe table (``tuning_space | num_experiments |
best_metric_val | best_exp_name``, one row per ZeRO stage ``z0``..``z3`` that ran and a
``global`` row), then ``Tuning completed in H:MM:SS. Total number of experiments: N.``, then
(shardwise's addition) one row per configuration with its status, its ``throughput``,
``latency`` and ``flops`` or its error, the pruned ones included.
``ds_config_optimal.json``: the best experiment's config without its ``autotuning``
section. ``cmd_optimal.txt``: the ``shardwise run`` line that trains with it.
"""

from __future__ import annotations

import datetime
import json
import shlex
from pathlib import Path

from shardwise.autotuning._experiment import AutotuningError
from shardwise.autotuning._space import Candidate
from shardwise.autotuning._tuner import Outcome, best_outcome
from shardwise.config._autotuning import METRICS


def _table(headers: list[str], rows: list[list], numeric: set[int]) -> str:
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        padded = [row[i].rjust(widths[i]) if i in numeric else row[i].ljust(widths[i]) for i in range(len(row))]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(("-" * (w + 1) + ":") if i in numeric else (":" + "-" * (w + 1)) for i, w in enumerate(widths))
        + "|"
    )
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _cell(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value).replace("|", "/")  # keep the columns


def summary_text(outcomes: list[Outcome], rejected: dict[Candidate, str], *, metric: str, seconds: float) -> str:
    """The contents of ``summary.txt`` (see the module docstring)."""
    spaces = sorted({o.candidate.stage for o in outcomes})
    rows = []
    for stage in spaces:
        ran = [o for o in outcomes if o.candidate.stage == stage]
        best = best_outcome(ran, metric)
        rows.append([f"z{stage}", len(ran), best.metrics[metric] if best else 0, best.candidate.name if best else ""])
    best = best_outcome(outcomes, metric)
    rows.append(["global", len(outcomes), best.metrics[metric] if best else 0, best.candidate.name if best else ""])
    head = _table(["tuning_space", "num_experiments", "best_metric_val", "best_exp_name"], rows, {1, 2})
    took = datetime.timedelta(seconds=round(seconds))
    done = f"\n\nTuning completed in {took}. Total number of experiments: {len(outcomes)}.\n"
    detail = [[o.candidate.name, o.status.value, *(o.metrics.get(m, "") for m in METRICS), o.error] for o in outcomes]
    detail += [[c.name, "pruned", *("" for _ in METRICS), why] for c, why in rejected.items()]
    every = _table(["exp_name", "status", *METRICS, "error"], detail, set())
    return head + done + "\nEvery configuration:\n" + every + "\n"


def write_results(
    results_dir: Path,
    outcomes: list[Outcome],
    rejected: dict[Candidate, str],
    *,
    metric: str,
    seconds: float,
    optimal: tuple[dict, list[str]] | None,
) -> None:
    """Write ``summary.txt`` and, with ``optimal`` (config, command), the two optimal files."""
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "summary.txt").write_text(summary_text(outcomes, rejected, metric=metric, seconds=seconds))
    for name in ("ds_config_optimal.json", "cmd_optimal.txt"):
        (results_dir / name).unlink(missing_ok=True)  # never leave a previous run's choice behind
    if optimal is not None:
        config, command = optimal
        (results_dir / "ds_config_optimal.json").write_text(json.dumps(config, indent=2) + "\n")
        (results_dir / "cmd_optimal.txt").write_text(shlex.join(command) + "\n")


def nothing_runnable(outcomes: list[Outcome], rejected: dict[Candidate, str], results_dir: Path) -> AutotuningError:
    """The error for a tuning run that measured no configuration: each one and why."""
    lines = [f"  {c.name}: pruned: {why}" for c, why in rejected.items()]
    lines += [f"  {o.candidate.name}: {o.status.value}: {o.error}" for o in outcomes]
    return AutotuningError(
        "no runnable configuration found; what each one failed with (logs in "
        f"{results_dir}/<name>/stderr.log):\n" + "\n".join(lines)
    )
