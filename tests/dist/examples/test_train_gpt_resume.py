"""The demo resumes: --resume continues from the saved step and data position, and the
resumed run's losses and final weights are those of a run never interrupted."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

from shardwise.checkpoint import consolidate

REPO = Path(__file__).resolve().parents[3]
# 34 blocks of 32 bytes: 3 micro-batches of 8 per rank and epoch, so with 2 micro-batches
# per step the steps straddle epochs and the step-2 checkpoint is mid-epoch
TINY = ["--width", "32", "--layers", "2", "--seq_len", "32", "--corpus_bytes", "1100"]


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _demo(tmp_path, *args):
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
            str(REPO / "examples" / "train_gpt.py"),
            *TINY,
            "--deepspeed_config",
            str(tmp_path / "config.json"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-8000:]
    # "step k | loss x | lr y | ... samples/s" every step (steps_per_print 1), rank 0's loss
    steps = {int(m[1]): m[2] for m in re.finditer(r"step (\d+) \| (loss [\d.]+ \| lr \S+)", proc.stderr)}
    return proc.stdout, steps


def test_resumed_demo_continues_as_if_never_stopped(tmp_path):
    config = json.loads((REPO / "examples" / "configs" / "zero0.json").read_text())
    config.update(steps_per_print=1, gradient_accumulation_steps=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _, straight_steps = _demo(tmp_path, "--steps", "6", "--save", str(straight), "--save_interval", "2")
    assert sorted(straight_steps) == [1, 2, 3, 4, 5, 6], straight_steps
    assert sorted(p.name for p in straight.iterdir()) == ["global_step2", "global_step4", "global_step6", "latest"]

    # what a job killed during step 3 leaves: the step-2 checkpoint, named by latest
    resumed.mkdir()
    shutil.copytree(straight / "global_step2", resumed / "global_step2")
    (resumed / "latest").write_text("global_step2")
    stdout, resumed_steps = _demo(
        tmp_path, "--steps", "6", "--save", str(resumed), "--save_interval", "2", "--resume", str(resumed)
    )
    assert f"resumed from {resumed / 'global_step2'} at step 2 (epoch 1, micro-batch 1)" in stdout, stdout
    assert sorted(resumed_steps) == [3, 4, 5, 6], resumed_steps
    for step, line in resumed_steps.items():
        assert line == straight_steps[step], (step, line, straight_steps[step])
    assert (resumed / "latest").read_text().strip() == "global_step6"
    final, reference = consolidate(resumed, "global_step6"), consolidate(straight, "global_step6")
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[key], reference[key]) for key in final)
