"""``shardwise run --autotuning tune|run``: build the space, prune it with the memory
estimator, run the survivors one at a time under a deadline, write the results, and (with
``run``) train with the best configuration.

[Note: autotuning pruning order]
With ``model_info.num_params`` in the config (or, with ``overwrite: false``, a count an
earlier tuning run wrote to ``results_dir/model_info.json``), the estimator prunes before
anything runs. Without it, the first experiment the search picks also writes the count
(the engine writes it when it is built and trains on; no separate model-info job as
DeepSpeed's tuner starts) and the estimator prunes the rest of the space from then on.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from shardwise.autotuning._experiment import AutotuningError, Launch, run_experiment, split_config_arg
from shardwise.autotuning._prune import MemoryBudget, prune
from shardwise.autotuning._report import nothing_runnable, write_results
from shardwise.autotuning._space import Candidate, build_space, data_parallel, experiment_config, optimal_config
from shardwise.autotuning._tuner import Outcome, Status, best_outcome, search
from shardwise.config import ConfigError, load_config
from shardwise.config._autotuning import AutotuningConfig, autotuning_config


@dataclass(frozen=True, kw_only=True)
class Resources:
    """The ranks every experiment runs on (the launcher flags' resolution)."""

    num_nodes: int
    ranks_per_node: int
    on_cpu: bool

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node


def memory_per_rank(tuning: AutotuningConfig, resources: Resources) -> float:
    """The bytes one rank may hold: the config's ``memory_per_rank``, else the device's
    memory on GPU, else this machine's RAM divided by its ranks."""
    if tuning.memory_per_rank is not None:
        return float(tuning.memory_per_rank)
    if not resources.on_cpu:
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / resources.ranks_per_node


def _dtype(user: dict) -> str:
    for name in ("fp16", "bf16"):
        if (user.get(name) or {}).get("enabled") is True:
            return name
    return "fp32"


def _read_user_config(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise AutotuningError(f"cannot read the DeepSpeed config {path!r}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise AutotuningError(f"the DeepSpeed config {path!r} is not valid JSON: {exc}") from None


def _checked(user: dict, space: list[Candidate], tuning: AutotuningConfig, world_size: int):
    """Candidates whose config loads, and the others with the config error."""
    kept, rejected = [], {}
    for candidate in space:
        dp = data_parallel(candidate, world_size=world_size, mp_size=tuning.mp_size)
        try:
            load_config(experiment_config(user, candidate, dp=dp, metric_path="metrics.json"), world_size=dp)
        except ConfigError as exc:
            rejected[candidate] = f"config error: {exc}"
        else:
            kept.append(candidate)
    return kept, rejected


def _known_params(tuning: AutotuningConfig, info_path: Path) -> int | None:
    """``model_info.num_params``, or the count an earlier run wrote (``overwrite: false``)."""
    if tuning.model_info is not None and tuning.model_info.num_params is not None:
        return tuning.model_info.num_params
    if not tuning.overwrite and info_path.is_file():
        return int(json.loads(info_path.read_text())["num_params"])
    return None


def _reused(folder: Path, candidate: Candidate, metric: str) -> Outcome | None:
    """An earlier run's outcome of ``candidate`` (``overwrite: false``), when it has ``metric``."""
    path = folder / "metrics.json"
    if path.is_file() and metric in (metrics := json.loads(path.read_text())):
        return Outcome(candidate, Status.MEASURED, metrics=metrics)
    return None


def _check_counted(outcome: Outcome, metric: str) -> None:
    """Refuse to rank by ``flops`` a model whose FLOPs the counter does not see."""
    if metric == "flops" and outcome.status is Status.MEASURED and not outcome.metrics.get("flops"):
        raise AutotuningError(
            f"experiment {outcome.candidate.name} counted no FLOPs: its model runs no matrix product, "
            "convolution or attention that torch.utils.flop_counter counts, so autotuning.metric "
            '"flops" cannot rank configurations; use "throughput" or "latency"'
        )


@dataclass
class _Experiments:
    """Runs the search's candidates; the first one run also counts the model's parameters
    when the config does not give them, and pruning applies from then on (see
    [Note: autotuning pruning order])."""

    user: dict
    tuning: AutotuningConfig
    launch: Launch
    resources: Resources
    num_params: int | None
    rejected: dict[Candidate, str]
    space: list[Candidate]

    @property
    def results_dir(self) -> Path:
        return Path(self.tuning.results_dir)

    @property
    def info_path(self) -> Path:
        return (self.results_dir / "model_info.json").resolve()

    def prune(self) -> None:
        kept, too_big = prune(self.space, _budget(self.user, self.tuning, self.resources, self.num_params))
        self.rejected.update(too_big)
        self.space = kept

    def __call__(self, candidate: Candidate) -> Outcome | None:
        if candidate in self.rejected:
            return None
        folder = self.results_dir / candidate.name
        metric = self.tuning.metric
        if not self.tuning.overwrite and (reused := _reused(folder, candidate, metric)) is not None and self.num_params:
            return reused
        dp = data_parallel(candidate, world_size=self.resources.world_size, mp_size=self.tuning.mp_size)
        config = experiment_config(self.user, candidate, dp=dp, metric_path=str((folder / "metrics.json").resolve()))
        counting = self.num_params is None
        if counting:
            self.info_path.unlink(missing_ok=True)
            config["autotuning"]["model_info_path"] = str(self.info_path)
        outcome = run_experiment(
            candidate,
            config,
            launch=self.launch,
            folder=folder,
            exps_dir=Path(self.tuning.exps_dir),
            timeout_s=self.tuning.experiment_timeout_s,
        )
        print(f"autotuning: {candidate.name}: {outcome.status.value} {outcome.metrics or outcome.error}", flush=True)
        _check_counted(outcome, metric)
        if counting:
            if not self.info_path.is_file():
                raise AutotuningError(
                    f"the first experiment ({folder}) wrote no parameter count ({outcome.status.value}: "
                    f"{outcome.error}); fix the script, or give autotuning.model_info.num_params"
                )
            self.num_params = int(json.loads(self.info_path.read_text())["num_params"])
            self.prune()
        return outcome


def _launch(script: str, args: list[str], index: int, launcher_args: list[str], tuning, launcher: str) -> Launch:
    return Launch(
        launcher_args=tuple(launcher_args),
        script=script,
        script_args=tuple(args),
        config_index=index,
        arg_mappings=dict(tuning.arg_mappings or {}),
        launcher=launcher,
    )


def tune(
    *,
    launcher_args: list[str],
    script: str,
    script_args: list[str],
    resources: Resources,
    launcher: str = "shardwise",
):
    """Run the whole search; returns (outcomes, best outcome, the command that trains with
    the best config). ``launcher`` starts the experiments with ``launcher_args`` (see
    [Note: autotuning launchers]).

    Raises:
        AutotuningError: no config argument, nothing runnable (each configuration and why).
        ConfigError: the user config, or its autotuning section, is wrong (named).
    """
    started = time.monotonic()
    args, index = split_config_arg(script_args)
    user = _read_user_config(args[index])
    tuning = autotuning_config(user.get("autotuning"))
    launch = _launch(script, args, index, launcher_args, tuning, launcher)
    results_dir = Path(tuning.results_dir)
    space, rejected = _checked(
        user, build_space(user, tuning, world_size=resources.world_size), tuning, resources.world_size
    )
    if not space:
        raise nothing_runnable([], rejected, results_dir)
    runner = _Experiments(user, tuning, launch, resources, None, rejected, space)
    runner.num_params = _known_params(tuning, runner.info_path)
    if runner.num_params is not None:
        runner.prune()  # before anything runs
    outcomes = search(space, tuning, runner)
    best = best_outcome(outcomes, tuning.metric)
    optimal = None
    if best is not None:
        best_config = json.loads((results_dir / best.candidate.name / "ds_config.json").read_text())
        best_config["autotuning"].pop("model_info_path", None)
        config_path = str((results_dir / "ds_config_optimal.json").resolve())
        optimal = (optimal_config(best_config), launch.user_command(config_path, best_config))
    seconds = time.monotonic() - started
    write_results(results_dir, outcomes, rejected, metric=tuning.metric, seconds=seconds, optimal=optimal)
    if best is None:
        raise nothing_runnable(outcomes, rejected, results_dir)
    return outcomes, best, launch.process_command(optimal[1])


def _budget(user: dict, tuning: AutotuningConfig, resources: Resources, num_params: int) -> MemoryBudget:
    return MemoryBudget(
        num_params=num_params,
        dtype=_dtype(user),
        num_nodes=resources.num_nodes,
        ranks_per_node=resources.ranks_per_node // tuning.mp_size or 1,  # tp/pp divide it further
        bytes_per_rank=memory_per_rank(tuning, resources),
        on_cpu=resources.on_cpu,
    )


def autotune(
    mode: str,
    *,
    launcher_args: list[str],
    script: str,
    script_args: list[str],
    resources: Resources,
    launcher: str = "shardwise",
) -> int:
    """``tune``: search and write the results; ``run``: then train with the best config.
    Returns the exit code."""
    _, best, command = tune(
        launcher_args=launcher_args, script=script, script_args=script_args, resources=resources, launcher=launcher
    )
    print(f"shardwise run --autotuning: the best configuration is {best.candidate.name} ({best.metrics})")
    if mode == "tune":
        return 0
    return subprocess.call(command)
