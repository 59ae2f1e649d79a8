"""Start the job: torchrun on this machine, or on every host over ssh, pdsh, srun or mpirun.

Each node runs PyTorch's own elastic launcher (``torch.distributed.run``) with
``--nnodes``/``--node_rank`` and the master's address, so process-group start-up is
PyTorch's (a c10d store at the master), not ours. Within a node, torchrun stops every
rank as soon as one fails. Across nodes, this module watches the per-node launchers and
stops all of them when one exits with an error.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.launcher._port import DEFAULT_MASTER_PORT
from shardwise.launcher.environment import NO_LOCAL_RANK_ENV, export_prefix, exports

ERROR_DIR_ENV = "SHARDWISE_ERROR_DIR"
"""``comm/_error_record.py``'s variable (the same string, checked by a test): importing it
from there would import ``shardwise.comm`` and torch into the launcher's process, which only
starts torchrun and waits ([Note: lazy package import] in ``shardwise/__init__.py``)."""

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
"""DeepSpeed's name for its environment file (read too; see ``environment.ENV_FILES``)."""
_STOP_GRACE_S = 5.0
NODE_RANK_PLACEHOLDER = {"pdsh": "%n", "slurm": "$SLURM_NODEID", "mpi": "$OMPI_COMM_WORLD_RANK"}
"""How each multi-node launcher tells a node its rank (expanded on the node)."""


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


def torchrun_command(spec: JobSpec, *, node_rank: str | int) -> list[str]:
    """The command one node runs: torchrun launching our entry wrapper around the script."""
    return [
        spec.python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={spec.num_nodes}",
        f"--node_rank={node_rank}",
        f"--nproc_per_node={spec.nproc_per_node}",
        f"--master_addr={spec.master_addr}",
        f"--master_port={spec.master_port}",
        "--max_restarts=0",
        f"--monitor_interval={spec.monitor_interval_s}",
        "-m",
        "shardwise.launcher._entry",
        spec.script,
        *spec.script_args,
    ]


def _job_env(spec: JobSpec, error_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(exports(env))
    env[ERROR_DIR_ENV] = error_dir
    if spec.no_local_rank:
        env[NO_LOCAL_RANK_ENV] = "1"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // spec.nproc_per_node)))
    return env


def _report_failure(error_dir: str, code: int) -> None:
    errors = []
    for path in Path(error_dir).glob("rank*.json"):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not errors:
        print(
            f"shardwise run: the job failed (exit code {code}); no rank recorded an error "
            "(a rank was killed or crashed hard: see the output above)",
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


def run_single_node(spec: JobSpec) -> int:
    """Run the job on this machine (one node, or this machine's part of a manual multi-node
    job when ``spec.num_nodes > 1``); returns the exit code."""
    with tempfile.TemporaryDirectory(prefix="shardwise-run-") as error_dir:
        cmd = torchrun_command(spec, node_rank=spec.node_rank)
        proc = subprocess.Popen(cmd, env=_job_env(spec, error_dir), start_new_session=True)
        code = _wait_forwarding_signals([proc])
        if code:
            _report_failure(error_dir, code)
        return code


def remote_command(
    spec: JobSpec, launcher: str, *, node_rank: str | int, exported: dict[str, str], visible_slots: list[int] | None
) -> str:
    """The shell line a remote node runs: cd, exports, then torchrun."""
    env = dict(exported)
    if spec.no_local_rank:
        env[NO_LOCAL_RANK_ENV] = "1"
    if visible_slots is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, visible_slots))
    line = " ".join(shlex.quote(part) for part in torchrun_command(spec, node_rank="__RANK__"))
    line = line.replace("__RANK__", str(node_rank))
    return f"cd {shlex.quote(os.getcwd())}; {export_prefix(env)}{line}"


def multinode_commands(
    spec: JobSpec, resources: dict[str, list[int]], launcher: str, *, ssh: list[str], cuda: bool
) -> list[list[str]]:
    """One command per launcher process: per host for ssh, one in total otherwise."""
    exported = exports()
    hosts = list(resources)
    if launcher == "ssh":
        return [
            [
                *ssh,
                host,
                remote_command(
                    spec, launcher, node_rank=rank, exported=exported, visible_slots=resources[host] if cuda else None
                ),
            ]
            for rank, host in enumerate(hosts)
        ]
    line = remote_command(
        spec, launcher, node_rank=NODE_RANK_PLACEHOLDER[launcher], exported=exported, visible_slots=None
    )
    if launcher == "pdsh":
        return [["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), line]]
    if launcher == "slurm":
        return [
            [
                "srun",
                f"--nodes={len(hosts)}",
                "--ntasks-per-node=1",
                f"--nodelist={','.join(hosts)}",
                "bash",
                "-c",
                line,
            ]
        ]
    if launcher == "mpi":
        return [
            [
                "mpirun",
                "-np",
                str(len(hosts)),
                "-H",
                ",".join(f"{h}:1" for h in hosts),
                "--map-by",
                "ppr:1:node",
                "bash",
                "-c",
                line,
            ]
        ]
    raise ValueError(f"unknown launcher {launcher!r}; use ssh, pdsh, slurm, mpi or local")


def run_multinode(commands: list[list[str]]) -> int:
    """Start every node's launcher; if one fails, stop the rest. Returns the exit code."""
    procs = [subprocess.Popen(cmd, start_new_session=True) for cmd in commands]
    return _wait_forwarding_signals(procs)


def _stop(procs: list[subprocess.Popen]) -> None:
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


def _wait_forwarding_signals(procs: list[subprocess.Popen]) -> int:
    """Wait for all processes; the first non-zero exit (or Ctrl-C / SIGTERM) stops them all."""
    interrupted = []

    def forward(signum, _frame):
        interrupted.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if interrupted or failed:
                _stop(procs)
                return failed[0] if failed else 128 + interrupted[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
