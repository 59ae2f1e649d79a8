"""The MoE demo trains through ``shardwise run`` with its experts split over the 2 ranks."""

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


def test_moe_demo_trains_with_experts_split(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardwise.cli",
            "run",
            "--nproc",
            "2",
            "--master_port",
            str(_free_port()),
            str(REPO / "examples" / "train_moe.py"),
            "--steps",
            "8",
            "--width",
            "32",
            "--layers",
            "2",
            "--seq_len",
            "32",
            "--corpus_bytes",
            "100000",
            "--print_every",
            "4",
            "--deepspeed_config",
            str(REPO / "examples" / "configs" / "moe_zero2.json"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-8000:]
    # each rank holds its half of the 8 experts: global ids 4r..4r+3 (DeepSpeed's layout)
    held = dict(re.findall(r"rank (\d): 1 MoE layers, experts (\[[\d, ]*\]) of 8 in each \(4 local\)", proc.stdout))
    assert held == {"0": "[0, 1, 2, 3]", "1": "[4, 5, 6, 7]"}, proc.stdout[-2000:]
    match = re.search(
        r"done: (\d+) steps .* loss ([\d.]+) -> ([\d.]+) .*; dropped ([\d.]+) of (\d+) routes", proc.stdout
    )
    assert match and int(match[1]) == 8, proc.stdout[-2000:]
    assert float(match[3]) < float(match[2])  # the loss falls even in 8 steps
    # 8 rows x 32 tokens x top-2 on rank 0, in its one MoE layer; capacity 1.25 leaves some room
    assert int(match[5]) == 512 and 0 <= float(match[4]) < 512
