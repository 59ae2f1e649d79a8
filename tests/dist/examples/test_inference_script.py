"""DeepSpeed's inference tutorial as a whole script (``examples/inference_tp.py``, started by
``shardwise run``): on 2 ranks with tensor parallelism it generates the tokens one rank
generates, with and without kernel injection."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(nproc: int, *extra: str) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise.cli", "run", "--nproc", str(nproc), "--master_port", str(_free_port()),
         str(REPO / "examples" / "inference_tp.py"), "--new_tokens", "24", *extra],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-8000:]
    assert re.search(r"time to first token [\d.]+ ms, [\d.]+ tokens/s \(1 x 24 tokens", proc.stdout), proc.stdout
    return re.search(rf"tp {nproc}: new tokens (\[.*\])", proc.stdout)[1]


def test_inference_script_on_two_ranks_generates_what_one_rank_generates():
    one = _run(1)
    assert len(one.split(",")) == 24
    assert _run(2) == one
    assert _run(2, "--no_kernel_inject") == one
