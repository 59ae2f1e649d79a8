"""One machine's ranks: start them, watch them, and stop them all when one fails.

``shardwise run`` does this itself for the ranks of the machine it runs on, and starts
``python -m shardwise.launcher.node`` on every other machine (over ssh, pdsh, srun or
mpirun), as DeepSpeed's launcher starts its per-node launcher. Each rank is
``python -u -m shardwise.launcher._entry SCRIPT ARGS`` with torchrun's variables set
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``...), so a script written for torchrun finds what it
expects, and rank 0 opens the rendezvous store at the master's address and port
(``init_process_group``'s ``env://`` method). Nothing here imports torch: a launch costs
one Python start per rank and nothing more ([Note: lazy package import] in
``shardwise/__init__.py``).

DeepSpeed's per-rank flags work the same way: ``--module`` runs the script argument as
``python -m`` does, ``--no_python`` runs it as an executable (``--local_rank=N`` first, and
no error record: the report then says how the rank ended), ``--enable_each_rank_log DIR``
sends each rank's output to ``DIR/<time>_rank<RANK>.log``, and ``--bind_cores_to_rank``
pins each rank to an equal share of ``--bind_core_list`` (or of the physical cores) with
``sched_setaffinity``, ``OMP_NUM_THREADS`` its number of cores (DeepSpeed runs numactl).

Each rank runs in a session of its own, so stopping a rank (SIGTERM, then SIGKILL after a
grace period) stops whatever it started too; and each rank is killed when the launcher
itself dies (``PR_SET_PDEATHSIG``), so even a launcher killed with SIGKILL leaves no rank.
The first rank to exit with an error stops the others, and the node exits with that
rank's code (128 + N for a rank killed by signal N); the error the rank recorded is
printed, or how it ended when it recorded none.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.launcher._port import DEFAULT_MASTER_PORT
from shardwise.launcher.environment import NO_LOCAL_RANK_ENV, exports

ERROR_DIR_ENV = "SHARDWISE_ERROR_DIR"
"""``comm/_error_record.py``'s variable (the same string, checked by a test): importing it
from there would import ``shardwise.comm`` and torch into the launcher's process."""

_STOP_GRACE_S = 5.0


@dataclass
class JobSpec:
    """Everything needed to start one job."""

    script: str
    script_args: list[str]
    nproc_per_node: int
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    no_local_rank: bool = False
    python: str = field(default_factory=lambda: sys.executable)
    monitor_interval_s: float = 0.1
    module: bool = False
    """Run ``script`` as a module (``python -m``)."""
    no_python: bool = False
    """Run ``script`` as an executable of its own (no Python, no error record)."""
    each_rank_log: str | None = None
    """A folder for each rank's stdout and stderr (``<time>_rank<RANK>.log``)."""
    bind_cores_to_rank: bool = False
    """Pin each rank to its own share of the cores (``bind_core_list``, or every physical
    core), with ``OMP_NUM_THREADS`` its number of cores."""
    bind_core_list: str | None = None


@dataclass
class Exit:
    """How the job ended: its exit code and, when a rank failed, which one (else None)."""

    code: int
    rank: int | None = None
    local_rank: int | None = None


def node_command(spec: JobSpec, *, node_rank: str | int) -> list[str]:
    """The command that starts one machine's ranks (on another machine, over ssh...)."""
    return [
        spec.python,
        "-m",
        "shardwise.launcher.node",
        f"--nnodes={spec.num_nodes}",
        f"--node_rank={node_rank}",
        f"--nproc_per_node={spec.nproc_per_node}",
        f"--master_addr={spec.master_addr}",
        f"--master_port={spec.master_port}",
        *(["--no_local_rank"] if spec.no_local_rank else []),
        *(["--module"] if spec.module else []),
        *(["--no_python"] if spec.no_python else []),
        *([f"--enable_each_rank_log={spec.each_rank_log}"] if spec.each_rank_log else []),
        *(["--bind_cores_to_rank"] if spec.bind_cores_to_rank else []),
        *([f"--bind_core_list={spec.bind_core_list}"] if spec.bind_core_list else []),
        spec.script,
        *spec.script_args,
    ]


def rank_env(spec: JobSpec, local_rank: int) -> dict[str, str]:
    """The variables torchrun sets for a rank, for rank ``local_rank`` of this machine."""
    world = spec.num_nodes * spec.nproc_per_node
    rank = spec.node_rank * spec.nproc_per_node + local_rank
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(spec.nproc_per_node),
        "GROUP_RANK": str(spec.node_rank),
        "GROUP_WORLD_SIZE": str(spec.num_nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default",
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(spec.master_port),
    }


def job_env(spec: JobSpec, error_dir: str) -> dict[str, str]:
    """The environment every rank of this machine shares (``rank_env`` adds the rest)."""
    env = dict(os.environ)
    env.update(exports(env))
    env[ERROR_DIR_ENV] = error_dir
    if spec.no_local_rank:
        env[NO_LOCAL_RANK_ENV] = "1"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // spec.nproc_per_node)))
    return env


class LaunchError(ValueError):
    """A launch that cannot start as asked (the message names the flag and the fix)."""


def rank_command(spec: JobSpec, local_rank: int) -> list[str]:
    """What rank ``local_rank`` runs: our entry wrapper around the script or module (it
    adds ``--local_rank``), or with ``no_python`` the script itself, ``--local_rank=N``
    first as DeepSpeed's launcher puts it."""
    if spec.no_python:
        if spec.module:
            raise LaunchError("--no_python and --module cannot be used together (a module needs Python)")
        return [spec.script, *([] if spec.no_local_rank else [f"--local_rank={local_rank}"]), *spec.script_args]
    target = ["-m", spec.script] if spec.module else [spec.script]
    return [spec.python, "-u", "-m", "shardwise.launcher._entry", *target, *spec.script_args]


def parse_core_list(text: str) -> list[int]:
    """``"1,3-5,7"`` -> ``[1, 3, 4, 5, 7]`` (DeepSpeed's ``--bind_core_list`` syntax)."""
    cores = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise LaunchError(f"--bind_core_list {text!r}: expected numbers and ranges like 1,3-5,7, got {part!r}")
        cores += range(int(first), int(last if dash else first) + 1)
    return cores


def physical_cores() -> list[int]:
    """One logical CPU per physical core this process may run on (the first of its
    hyper-thread siblings), as DeepSpeed binds to physical cores."""
    allowed = sorted(os.sched_getaffinity(0))
    seen, cores = set(), []
    for cpu in allowed:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topology / "physical_package_id").read_text(), (topology / "core_id").read_text())
        except OSError:
            return allowed
        if key not in seen:
            seen.add(key)
            cores.append(cpu)
    return cores


def rank_cores(spec: JobSpec) -> list[list[int]] | None:
    """Each local rank's cores under ``bind_cores_to_rank`` (equal contiguous shares)."""
    if not spec.bind_cores_to_rank:
        return None
    cores = parse_core_list(spec.bind_core_list) if spec.bind_core_list else physical_cores()
    share = len(cores) // spec.nproc_per_node
    if share < 1:
        raise LaunchError(
            f"--bind_cores_to_rank: {len(cores)} cores cannot give each of {spec.nproc_per_node} ranks one; "
            "start fewer ranks or give more cores in --bind_core_list"
        )
    return [cores[share * rank : share * (rank + 1)] for rank in range(spec.nproc_per_node)]


def _log_files(spec: JobSpec) -> list | None:
    if not spec.each_rank_log:
        return None
    folder = Path(spec.each_rank_log)
    if folder.is_file():
        raise LaunchError(f"--enable_each_rank_log {folder} is a file; give a folder (it is created if missing)")
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d%H%M%S")
    first = spec.node_rank * spec.nproc_per_node
    return [open(folder / f"{stamp}_rank{first + r}.log", "w") for r in range(spec.nproc_per_node)]  # noqa: SIM115


def run_node(spec: JobSpec) -> int:
    """Run this machine's ranks of the job until they all end or one fails; returns the
    exit code (and prints which rank failed first, and why)."""
    commands = [rank_command(spec, r) for r in range(spec.nproc_per_node)]
    cores = rank_cores(spec)
    with tempfile.TemporaryDirectory(prefix="shardwise-run-") as error_dir:
        env = job_env(spec, error_dir)
        logs = _log_files(spec)
        procs = []
        try:
            for local_rank, command in enumerate(commands):
                rank_vars = rank_env(spec, local_rank)
                if cores is not None:
                    rank_vars["OMP_NUM_THREADS"] = str(len(cores[local_rank]))
                out = None if logs is None else logs[local_rank]
                procs.append(
                    subprocess.Popen(
                        command,
                        env={**env, **rank_vars},
                        start_new_session=True,
                        stdout=out,
                        stderr=out,
                        preexec_fn=_child_setup(None if cores is None else cores[local_rank]),  # noqa: PLW1509
                    )
                )
        except OSError:
            stop(procs)
            raise
        finally:
            for log in logs or []:
                log.close()  # the ranks hold their own copies
        ended = wait_all(procs, interval_s=spec.monitor_interval_s)
        if ended.code and ended.local_rank is not None:
            ended.rank = spec.node_rank * spec.nproc_per_node + ended.local_rank
        if ended.code:
            report_failure(error_dir, ended)
        return ended.code


def report_failure(error_dir: str, ended: Exit) -> None:
    """Print the earliest error a rank recorded, or how the failing rank ended."""
    errors = []
    for path in Path(error_dir).glob("rank*.json"):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not errors:
        which = f"rank {ended.rank} (local rank {ended.local_rank}) " if ended.rank is not None else "a rank "
        print(
            f"shardwise run: {which}{_how(ended.code)} and recorded no error (it was killed or crashed "
            f"hard: see the output above); the other ranks were stopped",
            file=sys.stderr,
        )
        return
    first = min(errors, key=lambda e: e["time"])
    tail = "\n".join(first["error"].rstrip().splitlines()[-12:])
    others = sorted(int(e["rank"]) for e in errors if e is not first)
    also = f"; ranks {others} also failed" if others else ""
    print(
        f"\nshardwise run: rank {first['rank']} (local rank {first['local_rank']} on {first['host']}) "
        f"failed first{also}. The other ranks were stopped. Its error:\n{tail}",
        file=sys.stderr,
    )


_PR_SET_PDEATHSIG = 1


def _child_setup(cores: list[int] | None):
    """What a rank's process runs before the script: it is killed when the launcher dies
    (``PR_SET_PDEATHSIG``, Linux), so a launcher killed with SIGKILL leaves no rank behind,
    and, with ``bind_cores_to_rank``, it is pinned to its cores."""
    launcher = os.getpid()
    libc = _libc()

    def setup() -> None:
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != launcher:  # the launcher died before the call took effect
                os._exit(1)
        if cores is not None:
            os.sched_setaffinity(0, cores)

    return setup


def _libc():
    """The C library, for ``prctl`` (None where there is none to call: not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _how(code: int) -> str:
    if code > 128 and code - 128 in signal.valid_signals():
        return f"was ended by {signal.Signals(code - 128).name}"
    return f"exited with code {code}"


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each process's session, SIGKILL what is left after the grace period."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def wait_all(procs: list[subprocess.Popen], *, interval_s: float = 0.1) -> Exit:
    """Wait for all processes; the first non-zero exit (or Ctrl-C / SIGTERM) stops them all."""
    interrupted = []

    def forward(signum, _frame):
        interrupted.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if interrupted or failed:
                stop(procs)
                if failed:
                    return Exit(_exit_code(codes[failed[0]]), local_rank=failed[0])
                return Exit(128 + interrupted[0])
            if all(c == 0 for c in codes):
                return Exit(0)
            time.sleep(interval_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def add_rank_flags(add) -> None:
    """DeepSpeed's flags for how each rank starts (``shardwise run``'s and this module's)."""
    add("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    add("--module", action="store_true", help="run the script argument as a module, as 'python -m' does")
    add("--no_python", action="store_true", help="run the script as an executable of its own, without python")
    add(
        "--enable_each_rank_log",
        default=None,
        metavar="DIR",
        help="write each rank's stdout and stderr to DIR/<time>_rank<RANK>.log instead of the terminal",
    )
    add(
        "--bind_cores_to_rank",
        action="store_true",
        help="pin each rank to its own equal share of the cores (OMP_NUM_THREADS set to its count)",
    )
    add("--bind_core_list", default=None, help="the cores to share out, e.g. 0-3,8-11 (default: every physical core)")


def rank_options(args) -> dict:
    """The :class:`JobSpec` fields of the flags :func:`add_rank_flags` adds."""
    return {
        "no_local_rank": args.no_local_rank,
        "module": args.module,
        "no_python": args.no_python,
        "each_rank_log": args.enable_each_rank_log,
        "bind_cores_to_rank": args.bind_cores_to_rank,
        "bind_core_list": args.bind_core_list,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardwise.launcher.node", description=__doc__.split("\n")[0])
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node_rank", type=int, default=0)
    parser.add_argument("--nproc_per_node", type=int, default=1)
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT)
    add_rank_flags(parser.add_argument)
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    spec = JobSpec(
        script=args.script,
        script_args=list(args.script_args),
        nproc_per_node=args.nproc_per_node,
        num_nodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        **rank_options(args),
    )
    try:
        return run_node(spec)
    except LaunchError as error:
        print(f"shardwise run: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
