"""The long-sequence example fine-tunes a Hugging Face Llama through ``shardwise run`` with
each sequence split over the 2 ranks (Ulysses), tiled MLPs and activation checkpointing."""

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


def test_long_sequence_example_splits_each_sequence(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu")
    command = [sys.executable, "-m", "shardwise.cli", "run", "--nproc", "2", "--master_port", str(_free_port())]
    command += [str(REPO / "examples" / "finetune_long_llama.py"), "--seq_len", "256", "--steps", "4"]
    command += ["--hidden", "32", "--layers", "2", "--tiled_mlp", "2", "--checkpoint", "--print_every", "2"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-8000:]
    losses = [float(x) for x in re.findall(r"step +\d+ +loss ([\d.]+)", proc.stdout)]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses), proc.stdout
    pieces = re.findall(r"rank (\d): sequence 256 split over 2 ranks, piece (\d+) tokens", proc.stdout)
    assert sorted(pieces) == [("0", "128"), ("1", "128")], proc.stdout
