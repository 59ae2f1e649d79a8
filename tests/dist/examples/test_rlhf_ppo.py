"""RLHF step 3 (``examples/rlhf/step3_ppo.py``, started by ``shardwise run`` on 2 ranks): the
actor trains under ZeRO-3 with the hybrid engine and generates through
``actor_engine.module.generate`` with DeepSpeed-Chat's arguments (``synced_gpus``
included) on the fast decoder; PPO raises the reward of the answers it generates, which it
can only do if each generate samples from the weights of the last step."""

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


def test_ppo_step_raises_the_reward_through_the_hybrid_engine(tmp_path):
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
            str(REPO / "examples" / "rlhf" / "step3_ppo.py"),
            "--enable_ema",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-8000:]
    assert "actor: HybridEngine, ZeRO stage 3" in proc.stdout, proc.stdout[:500]
    # DeepSpeed-Chat's generate arguments stay on the fast decoder (no fallback logged)
    assert "runs the model's own generate" not in proc.stderr, proc.stderr[-3000:]
    rewards = [float(r) for r in re.findall(r"step \d+: reward ([\d.]+)", proc.stdout)]
    assert len(rewards) == 16, proc.stdout[-2000:]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.1, rewards  # from about 0.27 to about 0.42 polite tokens per answer
