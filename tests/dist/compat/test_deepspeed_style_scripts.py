"""Whole scripts written the way DeepSpeed's tutorials write them run on shardwise, under
torchrun and under `shardwise run` (which passes --local_rank=N as DeepSpeed's launcher
does), on 2 CPU ranks.

The module's launched jobs run two at a time in the background (see
shardwise.testing.background): a launcher's own start-up and a job's exit leave a core idle
that the other job's ranks use; each test checks its own job's results."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.testing.background import in_background

HERE = Path(__file__).parent
AT_ONCE = 2


def _env():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu")
    return env


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _launch(launcher, script, args, tmp_path):
    if launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            _free_port(),
            str(HERE / script),
            *args,
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "shardwise.cli",
            "run",
            "--nproc",
            "2",
            "--master_port",
            _free_port(),
            str(HERE / script),
            *args,
        ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    found = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    assert found, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(found[1]), proc


def _bert_resume(tmp_path):
    """6 steps saving every 3, then a resume from the step-3 checkpoint in the same directory."""
    full, proc = _launch("shardwise", "bert_style.py", ["--offload"], tmp_path)
    (tmp_path / "bert_ckpt" / "latest").write_text("global_step3")  # rewind to the step-3 checkpoint
    resumed, again = _launch(
        "torchrun", "bert_style.py", ["--load_checkpoint_dir", "bert_ckpt", "--checkpoint_dir", "again"], tmp_path
    )
    return full, proc.stdout, resumed, again.stdout


def _job_for(item):
    """The launched job of a test of this module, from its name and parameters."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    match item.originalname:
        case "test_cifar_style_script":
            args = ["--stage", str(params["stage"]), "--moe-param-group"]
            return lambda cwd: _launch(params["launcher"], "cifar_style.py", args, cwd)
        case "test_bert_style_script_resumes_exactly":
            return _bert_resume
        case "test_pipeline_style_script":
            return lambda cwd: _launch("shardwise", "pipeline_style.py", ["--steps", "40"], cwd)
    return None


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    with in_background(request, tmp_path_factory, _job_for, at_once=AT_ONCE) as started:
        yield started


@pytest.mark.parametrize("launcher,stage", [("shardwise", 2), ("torchrun", 3), ("torchrun", 1)])
def test_cifar_style_script(jobs, request, launcher, stage):
    r, _ = jobs[request.node.name].result()
    assert r["world_size"] == 2 and r["stage"] == stage and r["backend"] == "gloo" and r["device"] == "cpu"
    # shardwise run passes --local_rank=N; torchrun does not (the script's default stays)
    assert r["local_rank_arg"] == (0 if launcher == "shardwise" else -1)
    assert r["local_rank"] == r["env_local_rank"] == r["dist_local_rank"] == 0
    assert r["steps"] == 2 * 64 // 16  # 2 epochs of 64 samples, global batch 16
    assert r["last_loss"] < r["first_loss"] and r["grad_norm_positive"]
    assert r["gathered"] == [0.0, 1.0] and r["broadcast"] == 7.0 and r["client_state"] == 2
    assert r["consolidated_vs_live"] == 0.0
    assert r["lr"] == pytest.approx(0.01)


def _steps(text):
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^STEP (\d+) ([\d.]+)$", text, re.M)}


def test_bert_style_script_resumes_exactly(jobs, request):
    """Run 6 steps saving every 3 (with offload_states round trips); then resume from the
    step-3 checkpoint: steps 4-6 give the same losses as the uninterrupted run."""
    full, full_out, resumed, resumed_out = jobs[request.node.name].result()
    straight = _steps(full_out)
    assert full["partitioned_at_init"] and full["global_steps"] == 6 and full["gas"] == 2
    assert full["exp_avg_shape"] == full["saved_head"] == [50, 32]
    again = _steps(resumed_out)
    assert sorted(again) == [4, 5, 6] and resumed["global_steps"] == 6
    for step in (4, 5, 6):
        assert again[step] == pytest.approx(straight[step], abs=1e-6), (step, again, straight)
    assert straight[6] < straight[1]


def test_pipeline_style_script(jobs, request):
    r, _ = jobs[request.node.name].result()
    assert r["stages"] == 2 and r["first"] and r["gas"] == 4 and r["global_steps"] == 40
    assert r["layers"] == ["0"]  # by parameters: stage 0 holds layers 0-1 (1088), stage 1 layers 2-4 (4420)
    first, last = sum(r["losses"][:5]) / 5, sum(r["losses"][-5:]) / 5
    assert last < 0.5 * first, r["losses"]
