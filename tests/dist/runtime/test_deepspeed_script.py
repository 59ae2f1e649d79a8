"""A DeepSpeed training script runs with only its import line changed."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_deepspeed_script_runs_under_torchrun(tmp_path):
    script = REPO / "examples" / "deepspeed_script.py"
    source = script.read_text()
    code = source.replace(ast.get_docstring(ast.parse(source), clean=False), "")
    assert code.count("shardwise") == 1 and "import shardwise as deepspeed" in code
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDWISE_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            "--deepspeed_config",
            str(REPO / "examples" / "configs" / "zero0.json"),
            "--save_dir",
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"trained (\d+) steps; loss ([\d.]+) -> ([\d.]+)", proc.stdout)
    assert match, proc.stdout + proc.stderr[-2000:]
    steps, first, last = int(match[1]), float(match[2]), float(match[3])
    assert steps == 3 * 512 // 16  # 3 epochs of 512 samples, global batch 2 ranks x 8
    assert last < first
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"global_step{steps}"


def test_plain_python_runs_as_a_world_of_one(tmp_path):
    script = REPO / "examples" / "deepspeed_script.py"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--epochs",
            "1",
            "--deepspeed_config",
            str(REPO / "examples" / "configs" / "zero0.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained 64 steps" in proc.stdout  # 512 samples / micro-batch 8 on one rank
