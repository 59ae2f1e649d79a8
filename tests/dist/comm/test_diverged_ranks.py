"""Ranks that diverge fail the whole job within the collective deadline, at every ZeRO stage.

The last rank runs one training step more than rank 0, which then stalls (as a rank stuck
in data loading would). The waiting rank must raise CollectiveError naming the collective
within ``comm.timeout_s``, exit at once (no exit barrier, no teardown of a group with a
collective in flight), and the launcher must then stop rank 0.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("diverged_script.py")
TIMEOUT_S = 5
MARGIN_S = 40
"""Start-up of two ranks on a loaded 2-core CI machine (~5 s when quiet), the grace for
the peers' states (half the deadline here) and the launcher stopping rank 0. This bounds
a hang, not a speed: without the fix the job ends only when rank 0's stall (STALL_S)
does, or never."""
STALL_S = 150
KILL_AFTER_S = 120


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu")
    return env


def _run_diverged(launcher, tmp_path, *script_args):
    port = str(_free_port())
    if launcher == "shardwise run":
        cmd = [sys.executable, "-m", "shardwise.cli", "run", "--nproc", "2", "--master_port", port]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", port, "--max_restarts", "0"]
    cmd += [str(SCRIPT), "--timeout_s", str(TIMEOUT_S), "--stall_s", str(STALL_S), *script_args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=KILL_AFTER_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return proc.returncode, out, time.monotonic() - start


def _check(code, out, elapsed, kind):
    assert code != 0, out[-3000:]
    assert (f"CollectiveError: rank 1 waited in data-parallel group rank 1: {kind} #" in out
            and "[gradient bucket 0] which did not complete within 5 s" in out), out[-3000:]
    assert elapsed < TIMEOUT_S + MARGIN_S, f"the job took {elapsed:.1f} s:\n{out[-3000:]}"


@pytest.mark.parametrize("stage, kind", [(0, "all_reduce"), (1, "reduce_scatter"), (2, "reduce_scatter"),
                                         (3, "reduce_scatter")])
def test_diverged_ranks_fail_fast_under_shardwise_run(tmp_path, stage, kind):
    code, out, elapsed = _run_diverged("shardwise run", tmp_path, "--stage", str(stage))
    _check(code, out, elapsed, kind)
    assert "shardwise run: rank 1 (local rank 1" in out and "failed first" in out


@pytest.mark.parametrize("stage, offload, kind", [(0, False, "all_reduce"), (2, True, "reduce_scatter")])
def test_diverged_ranks_fail_fast_under_torchrun(tmp_path, stage, offload, kind):
    code, out, elapsed = _run_diverged("torchrun", tmp_path, "--stage", str(stage),
                                       *(["--offload"] if offload else []))
    _check(code, out, elapsed, kind)
