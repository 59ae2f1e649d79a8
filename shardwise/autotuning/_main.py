"""``shardwise run --autotuning tune|run``: build the space, prune it with the memory
estimator, run the survivors one at a time under a deadline, write the results, and (with
``run``) train with the best configuration."""

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
from shardwise.autotuning._space import Candidate, build_space, experiment_config, optimal_config
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


def _checked(user: dict, space: list[Candidate], dp: int) -> tuple[list[Candidate], dict[Candidate, str]]:
    """Candidates whose config loads, and the others with the config error."""
    kept, rejected = [], {}
    for candidate in space:
        try:
            load_config(experiment_config(user, candidate, dp=dp, metric_path="metrics.json"), world_size=dp)
        except ConfigError as exc:
            rejected[candidate] = f"config error: {exc}"
        else:
            kept.append(candidate)
    return kept, rejected


def _count_params(user, candidate, tuning, *, launch, results_dir, exps_dir, dp) -> int:
    """The model's parameter count: ``model_info.num_params``, else a model-info run."""
    if tuning.model_info is not None and tuning.model_info.num_params is not None:
        return tuning.model_info.num_params
    folder = results_dir / "profile_model_info"
    info_path = folder / "model_info.json"
    info_path.unlink(missing_ok=True)
    config = experiment_config(user, candidate, dp=dp, metric_path=str(folder / "metrics.json"))
    config["autotuning"].update(model_info={"profile": True}, model_info_path=str(info_path.resolve()))
    outcome = run_experiment(
        candidate,
        config,
        launch=launch,
        folder=folder,
        exps_dir=exps_dir,
        timeout_s=tuning.experiment_timeout_s,
        name=folder.name,
    )
    if not info_path.is_file():
        raise AutotuningError(
            f"the model-info run ({folder}) wrote no parameter count ({outcome.status.value}: {outcome.error}); "
            "fix the script, or give autotuning.model_info.num_params"
        )
    return int(json.loads(info_path.read_text())["num_params"])


def _reused(folder: Path, candidate: Candidate) -> Outcome | None:
    metrics = folder / "metrics.json"
    if metrics.is_file():
        return Outcome(candidate, Status.MEASURED, metrics=json.loads(metrics.read_text()))
    return None


def tune(*, launcher_args: list[str], script: str, script_args: list[str], resources: Resources):
    """Run the whole search; returns (outcomes, best outcome, the command that trains with
    the best config).

    Raises:
        AutotuningError: no config argument, nothing runnable (each configuration and why).
        ConfigError: the user config, or its autotuning section, is wrong (named).
    """
    started = time.monotonic()
    args, index = split_config_arg(script_args)
    user = _read_user_config(args[index])
    tuning = autotuning_config(user.get("autotuning"))
    launch = Launch(
        launcher_args=tuple(launcher_args),
        script=script,
        script_args=tuple(args),
        config_index=index,
        arg_mappings=dict(tuning.arg_mappings or {}),
    )
    results_dir, exps_dir = Path(tuning.results_dir), Path(tuning.exps_dir)
    dp = resources.world_size // tuning.mp_size
    space, rejected = _checked(user, build_space(user, tuning, world_size=resources.world_size), dp)
    if not space:
        raise nothing_runnable([], rejected, results_dir)
    num_params = _count_params(user, space[0], tuning, launch=launch, results_dir=results_dir, exps_dir=exps_dir, dp=dp)
    space, too_big = prune(space, _budget(user, tuning, resources, num_params))
    rejected.update(too_big)

    def run_one(candidate: Candidate) -> Outcome:
        folder = results_dir / candidate.name
        if not tuning.overwrite and (reused := _reused(folder, candidate)) is not None:
            return reused
        config = experiment_config(user, candidate, dp=dp, metric_path=str((folder / "metrics.json").resolve()))
        outcome = run_experiment(
            candidate, config, launch=launch, folder=folder, exps_dir=exps_dir, timeout_s=tuning.experiment_timeout_s
        )
        print(f"autotuning: {candidate.name}: {outcome.status.value} {outcome.metrics or outcome.error}", flush=True)
        return outcome

    outcomes = search(space, tuning, run_one)
    best = best_outcome(outcomes, tuning.metric)
    optimal = None
    if best is not None:
        best_config = json.loads((results_dir / best.candidate.name / "ds_config.json").read_text())
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
        ranks_per_node=resources.ranks_per_node // tuning.mp_size or 1,
        bytes_per_rank=memory_per_rank(tuning, resources),
        on_cpu=resources.on_cpu,
    )


def autotune(mode: str, *, launcher_args: list[str], script: str, script_args: list[str], resources: Resources) -> int:
    """``tune``: search and write the results; ``run``: then train with the best config.
    Returns the exit code."""
    _, best, command = tune(launcher_args=launcher_args, script=script, script_args=script_args, resources=resources)
    print(f"shardwise run --autotuning: the best configuration is {best.candidate.name} ({best.metrics})")
    if mode == "tune":
        return 0
    return subprocess.call(command)
