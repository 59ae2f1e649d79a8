"""Running one experiment: its files in DeepSpeed's layout, the launched job, its deadline.

Each experiment is a ``shardwise run`` job (the launcher's own flags, so the same ranks and
hosts as the tuner was given), or a ``torchrun`` / ``accelerate launch`` job with the flags
the user gave that launcher (see [Note: autotuning launchers]), of the user's script, with
the config path among the script's arguments replaced by the experiment's config. Its folder
``results_dir/<name>/`` holds ``ds_config.json``, ``exp.json``, ``cmd.txt``, ``stdout.log``,
``stderr.log`` and, when it reached ``end_profile_step``, ``metrics.json``;
``exps_dir/<name>.json`` describes it before it starts. A job still running at its deadline
is ended with its whole process tree: the launcher's process group and every descendant
(torchrun starts each rank in a session of its own, out of reach of the group), SIGTERM
first, SIGKILL after a grace.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shardwise.autotuning._errors import AutotuningError
from shardwise.autotuning._launchers import launcher_head, launcher_module
from shardwise.autotuning._space import Candidate
from shardwise.autotuning._tuner import Outcome, Status

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")
"""The script flags DeepSpeed's tuner reads the config path from, in its order."""
_KILL_GRACE_S = 3.0
_ERROR_LINES = 15


def split_config_arg(script_args: list[str]) -> tuple[list[str], int]:
    """``script_args`` with the config flag's value as its own token, and that token's index.

    Raises:
        AutotuningError: no ``--deepspeed_config PATH`` / ``--deepspeed PATH`` among them.
    """
    args = []
    for arg in script_args:
        flag, eq, value = arg.partition("=")
        args.extend([flag, value] if eq and flag in CONFIG_FLAGS else [arg])
    for flag in CONFIG_FLAGS:
        if flag in args:
            index = args.index(flag) + 1
            # DeepSpeed's rule: --deepspeed is also a switch, so its value counts only as a .json path
            if index < len(args) and (flag == "--deepspeed_config" or ".json" in args[index]):
                return args, index
    raise AutotuningError(
        "--autotuning needs the DeepSpeed config among the script's arguments: "
        "'--deepspeed ds_config.json' or '--deepspeed_config ds_config.json'"
    )


@dataclass(frozen=True, kw_only=True)
class Launch:
    """How every experiment (and the final run) is started."""

    launcher_args: tuple[str, ...]
    """The launcher's flags the tuner was given (hosts, ranks, ports...)."""
    script: str
    script_args: tuple[str, ...]
    """The script's arguments, the config path at ``config_index``."""
    config_index: int
    arg_mappings: dict
    """Config key (dotted for nested keys) -> script flag given the experiment's value."""
    launcher: str = "shardwise"
    """``shardwise``, ``torchrun`` or ``accelerate`` (see [Note: autotuning launchers])."""
    python: str = sys.executable

    def user_command(self, config_path: str, config: dict) -> list[str]:
        """``shardwise run ... script args`` (or the torchrun / accelerate line) with
        ``config_path`` as the config."""
        args = list(self.script_args)
        args[self.config_index] = config_path
        for key, flag in self.arg_mappings.items():
            value = _lookup(config, key)
            if value is None or value == "auto":
                continue
            if flag in args and args.index(flag) + 1 < len(args):
                args[args.index(flag) + 1] = str(value)
            else:
                args += [flag, str(value)]
        return [*launcher_head(self.launcher), *self.launcher_args, self.script, *args]

    def process_command(self, user_command: list[str]) -> list[str]:
        """The command line that runs ``user_command`` with this interpreter."""
        head = len(launcher_head(self.launcher))
        return [self.python, "-m", *launcher_module(self.launcher), *user_command[head:]]


def _lookup(config: dict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def run_experiment(
    candidate: Candidate,
    config: dict,
    *,
    launch: Launch,
    folder: Path,
    exps_dir: Path,
    timeout_s: float,
    name: str | None = None,
) -> Outcome:
    """Write ``candidate``'s files (under ``name``, default the candidate's), run it under
    ``timeout_s`` and read what it gave."""
    name = name or candidate.name
    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.json", "stdout.log", "stderr.log"):
        (folder / stale).unlink(missing_ok=True)
    config_path = folder / "ds_config.json"
    _write_json(config_path, config)
    command = launch.user_command(str(config_path.resolve()), config)
    description = {"name": name, "ds_config": config, "cmd": shlex.join(command)}
    _write_json(exps_dir / f"{name}.json", description)
    _write_json(folder / "exp.json", description)
    (folder / "cmd.txt").write_text(shlex.join(command) + "\n")
    code = run_with_deadline(launch.process_command(command), folder=folder, timeout_s=timeout_s)
    if code is None:
        return Outcome(
            candidate,
            Status.HUNG,
            error=f"still running after {timeout_s:g} s (autotuning.experiment_timeout_s); killed",
        )
    metrics_path = folder / "metrics.json"
    if code != 0:
        return Outcome(candidate, Status.FAILED, error=f"exit code {code}: {error_tail(folder / 'stderr.log')}")
    if not metrics_path.is_file():
        return Outcome(
            candidate,
            Status.NO_METRIC,
            error=NO_METRIC_ERROR.format(end=config["autotuning"].get("end_profile_step", 5)),
        )
    return Outcome(candidate, Status.MEASURED, metrics=json.loads(metrics_path.read_text()))


def run_with_deadline(command: list[str], *, folder: Path, timeout_s: float) -> int | None:
    """Run ``command`` in a session of its own, its output in ``folder/stdout.log`` and
    ``folder/stderr.log``; its exit code, or None when it was still running after
    ``timeout_s`` seconds and was ended with every process below it."""
    with open(folder / "stdout.log", "wb") as out, open(folder / "stderr.log", "wb") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            return None
        except BaseException:  # Ctrl-C reaches only the tuner (the job has its own session)
            kill_tree(proc)
            raise


NO_METRIC_ERROR = (
    "the script exited cleanly without reaching autotuning.end_profile_step={end}: it ran fewer optimizer "
    "steps, or it does not train through shardwise's engine (shardwise.initialize / deepspeed.initialize), "
    "or it does not pass the --deepspeed config to it"
)


def error_tail(stderr_log: Path) -> str:
    """The last lines of an experiment's error output (from the launcher's report of the
    rank that failed first, when there is one)."""
    text = stderr_log.read_text(errors="replace") if stderr_log.is_file() else ""
    marker = text.rfind("shardwise run: rank")
    lines = (text[marker:] if marker >= 0 else text).strip().splitlines()
    return " / ".join(line.strip() for line in lines[-_ERROR_LINES:] if line.strip()) or "(no error output)"


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rfind(")") + 2 :].split()[1])  # the command may hold spaces
        children.setdefault(parent, []).append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux /proc; empty elsewhere)."""
    if not Path("/proc").is_dir():
        return []
    children, found, stack = _children_map(), [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _signal_all(proc: subprocess.Popen, pids: list[int], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_tree(proc: subprocess.Popen) -> None:
    """End ``proc`` (started in a session of its own) and every process below it."""
    pids = descendants(proc.pid)  # collected first: a killed parent's children move to init
    _signal_all(proc, pids, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_GRACE_S
    while time.monotonic() < deadline and (proc.poll() is None or any(_alive(p) for p in pids)):
        time.sleep(0.05)
    _signal_all(proc, [p for p in pids if _alive(p)], signal.SIGKILL)
    proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] == "Z"
