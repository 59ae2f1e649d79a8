"""Launch a 2-rank job under ``torchrun`` or ``shardwise run`` and bound it (the failure
tests of comm/ and pipe/ start theirs with ``shardwise.testing.background``)."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(launcher, cwd, script, *script_args, kill_after_s, env=None):
    """Run ``script`` on 2 ranks under ``launcher`` ("torchrun" or "shardwise run") in ``cwd``
    with ``env`` added to this process's environment; kill the job and all its processes
    after ``kill_after_s``. Returns (exit code, stdout and stderr, seconds it took)."""
    port = str(_free_port())
    if launcher == "shardwise run":
        cmd = [sys.executable, "-m", "shardwise.cli", "run", "--nproc", "2", "--master_port", port]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            port,
            "--max_restarts",
            "0",
        ]
    job_env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    job_env.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu", **(env or {}))
    start = time.monotonic()
    proc = subprocess.Popen(
        [*cmd, str(script), *script_args],
        cwd=cwd,
        env=job_env,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = proc.communicate(timeout=kill_after_s)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own: kill them by ancestry.
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, _ = proc.communicate()
    return proc.returncode, out, time.monotonic() - start


def _descendants(pid):
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
