"""DeepSpeed's inference tutorial as a whole script (``examples/inference_tp.py``): started by
``shardwise run`` on 2 ranks with tensor parallelism it generates the tokens one rank
generates, and so does it on 2 ranks without kernel injection.

Only the run with kernel injection is a launched job (each costs a Python start and the
imports of every rank); the same script also runs in this process for the one-rank reference
and in the test ranks of ``run_distributed`` without kernel injection."""

import contextlib
import io
import os
import re
import runpy
import socket
import subprocess
import sys
from pathlib import Path

from shardwise.testing import run_distributed

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "examples" / "inference_tp.py"
ARGS = ("--new_tokens", "24")
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tokens(nproc: int, stdout: str) -> str:
    """The new tokens the script printed, after checking it printed its timing line too."""
    assert re.search(r"time to first token [\d.]+ ms, [\d.]+ tokens/s \(1 x 24 tokens", stdout), stdout
    return re.search(rf"tp {nproc}: new tokens (\[.*\])", stdout)[1]


def _launch(nproc: int, *extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardwise.cli",
            "run",
            "--nproc",
            str(nproc),
            "--master_port",
            str(_free_port()),
            str(SCRIPT),
            *ARGS,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-8000:]
    return _tokens(nproc, proc.stdout)


def _run_script(*extra: str) -> str:
    """The script run as ``__main__`` in this process, with its arguments; what it printed."""
    argv, out = sys.argv, io.StringIO()
    sys.argv = [str(SCRIPT), *ARGS, *extra]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


def _script_on_a_rank(rank, world_size, extra):
    return _run_script(*extra)


def test_inference_script_on_two_ranks_generates_what_one_rank_generates(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    one = _tokens(1, _run_script())
    assert len(one.split(",")) == 24
    assert _launch(2) == one
    printed = run_distributed(_script_on_a_rank, world_size=2, extra=("--no_kernel_inject",))
    assert printed[1] == ""  # only rank 0 prints
    assert _tokens(2, printed[0]) == one
