"""The demo trains unchanged under ZeRO stages 0-3, bf16 and both offloads: only the config
differs. A sample of the shipped configs runs here (each run is a launch of 2 processes);
tests/unit/examples/test_example_configs.py reads every one of them.

The module's launches run two at a time in the background (see
shardwise.testing.background): a launcher's own start-up and a job's exit leave a core idle
that the other job's ranks use; each test checks its own launch's output."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.testing.background import in_background

REPO = Path(__file__).resolve().parents[3]
AT_ONCE = 2


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _demo(cwd, config, steps):
    """The demo on 2 ranks for ``steps`` steps under ``config``, saving to ``cwd/ckpt``."""
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
            "--steps",
            str(steps),
            "--width",
            "32",
            "--layers",
            "2",
            "--seq_len",
            "32",
            "--corpus_bytes",
            "100000",
            "--deepspeed_config",
            str(REPO / "examples" / "configs" / config),
            "--save",
            str(cwd / "ckpt"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-8000:]
    return proc, cwd


def _job_for(item):
    """The launch of a test of this module, from its name and parameters."""
    match item.originalname:
        case "test_demo_runs_under_config":
            return lambda cwd: _demo(cwd, item.callspec.params["config"], 6)
        case "test_demo_with_onebit_adam":
            return lambda cwd: _demo(cwd, "onebit_adam.json", 30)
    return None


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    with in_background(request, tmp_path_factory, _job_for, at_once=AT_ONCE) as started:
        yield started


# stage 1 is left to the engine tests (tests/dist/runtime, tests/dist/zero): a launch costs ~7 s
@pytest.mark.parametrize(
    "config", ["zero0_bf16.json", "zero3.json", "zero2_offload_cpu.json", "zero3_offload_nvme.json"]
)
def test_demo_runs_under_config(jobs, request, config):
    proc, cwd = jobs[request.node.name].result()
    match = re.search(r"done: (\d+) steps .* loss ([\d.]+) -> ([\d.]+)", proc.stdout)
    assert match and int(match[1]) == 6, proc.stdout[-2000:]
    assert float(match[3]) < float(match[2])  # the loss falls even in 6 steps
    # the full parameter count, also when zero.Init built the model partitioned (stage 3)
    assert "model: 0.03M parameters" in proc.stdout, proc.stdout[:500]
    assert (cwd / "ckpt" / "latest").read_text().strip() == "global_step6"


def test_demo_with_onebit_adam(jobs, request):
    """DeepSpeed's 1-bit Adam tutorial in miniature: the same script, a config with type
    OneBitAdam and fp16; after freeze_step (20) the progress lines show the compressed
    exchange instead of the gradient all-reduce."""
    proc, cwd = jobs[request.node.name].result()
    assert "OneBitAdam: warm-up of 20 steps done" in proc.stderr, proc.stderr[-3000:]
    lines = {int(m[1]): m[2] for m in re.finditer(r"step (\d+) \|.*data-parallel payload ([^\n]*)", proc.stderr)}
    assert "all_reduce" in lines[10] and "all_to_all" not in lines[10], lines
    assert "all_to_all" in lines[30] and "all_gather" in lines[30], lines
    match = re.search(r"done: (\d+) steps .* loss ([\d.]+) -> ([\d.]+)", proc.stdout)
    assert match and int(match[1]) == 30 and float(match[3]) < float(match[2]), proc.stdout[-2000:]
    assert (cwd / "ckpt" / "global_step30" / "optimizer_rank1.safetensors").is_file()
