"""``shardwise run --autotuning run`` against DeepSpeed 0.19.8's ``deepspeed --autotuning run``
on the same script and config: tuning wall time, what each chose, and the chosen
configurations' throughput measured the same way afterwards.

The workload (written to a temporary folder) is an MLP (``--width``, ``--layers``) trained
with AdamW on random batches; it imports ``deepspeed`` where that is installed (DeepSpeed's
environment, ``--ds-python``) and shardwise otherwise, and takes the config through
``--deepspeed --deepspeed_config PATH`` as DeepSpeed's tuner expects. Both tuners get the same
``autotuning`` section (``--stages``, micro-batch bounds, profile steps 2..4). Afterwards each
chosen config is run once more under shardwise's engine in profile mode (same script, same
ranks) so the two choices are compared on one yardstick::

    python bench/bench_autotuning.py --out bench/results/<date>-cpu-autotuning.md
    # a quick smoke run
    python bench/bench_autotuning.py --width 64 --layers 2 --stages 0,1 --max-micro 2

A tuner that fails, or is still running after ``--timeout`` (its whole process tree is then
killed), is reported with its exit code and the tail of its output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardwise.autotuning._experiment import kill_tree

WORKLOAD = """
import argparse, os
import torch
try:
    import deepspeed
except ImportError:
    import shardwise as deepspeed
parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--width", type=int, default=512)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--steps", type=int, default=8)
args = parser.parse_args()
torch.manual_seed(0)
blocks = [torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.GELU()) for _ in range(args.layers)]
model = torch.nn.Sequential(*blocks, torch.nn.Linear(args.width, 1))
engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
for _ in range(args.steps * gas):
    x = torch.randn(micro, args.width)
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
"""


def _config(args, results: Path) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": [int(s) for s in args.stages.split(",")]},
        "autotuning": {
            "enabled": True,
            "fast": True,
            "start_profile_step": 2,
            "end_profile_step": 4,
            "results_dir": str(results / "autotuning_results"),
            "exps_dir": str(results / "autotuning_exps"),
            "max_train_micro_batch_size_per_gpu": args.max_micro,
            "num_tuning_micro_batch_sizes": 3,
        },
    }


def _tune(name: str, command: list[str], cwd: Path, timeout_s: float, *, path_dir: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDWISE_ACCELERATOR": "cpu", "DS_ACCELERATOR": "cpu"}
    env["PATH"] = f"{path_dir}{os.pathsep}{env.get('PATH', '')}"  # DeepSpeed's tuner runs `deepspeed` from PATH
    started = time.monotonic()
    log = cwd / "tuner.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc)  # the whole tree: DeepSpeed's experiments run below its runner
            code = f"killed after {timeout_s:g} s"
    seconds = time.monotonic() - started
    output = log.read_text(errors="replace")
    optimal = cwd / "autotuning_results" / "ds_config_optimal.json"
    chosen = json.loads(optimal.read_text()) if optimal.is_file() else None
    tail = " | ".join(str(output).strip().splitlines()[-6:])
    return {"name": name, "code": code, "seconds": seconds, "chosen": chosen, "tail": tail}


def _measure(config: dict, workload: Path, args, folder: Path) -> float | None:
    """Throughput of ``config`` under shardwise's engine in profile mode (samples/s)."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "metrics.json"
    config = {**config, "autotuning": {"enabled": True, "start_profile_step": 3, "end_profile_step": 8,
                                       "metric_path": str(metrics)}}  # fmt: skip
    (folder / "ds_config.json").write_text(json.dumps(config))
    command = [sys.executable, "-m", "shardwise.cli", "run", "--nproc", str(args.nproc), str(workload),
               "--deepspeed", "--deepspeed_config", str(folder / "ds_config.json"), *_script_args(args),
               "--steps", "20"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDWISE_ACCELERATOR": "cpu"}
    subprocess.run(command, cwd=folder, env=env, capture_output=True, timeout=args.timeout)
    return json.loads(metrics.read_text())["throughput"] if metrics.is_file() else None


def _script_args(args) -> list[str]:
    return ["--width", str(args.width), "--layers", str(args.layers)]


def _describe(config: dict | None) -> str:
    if config is None:
        return "none"
    zero = config.get("zero_optimization", {})
    micro, gas = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps")
    return f"stage {zero.get('stage')}, micro-batch {micro}, accumulation {gas}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--max-micro", type=int, default=16)
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks (DeepSpeed's CPU accelerator has one device: its tuner refuses more)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per tuner before its tree is killed")
    parser.add_argument("--ds-python", default=os.environ.get("DS_PYTHON", "/work/ds-env/bin/python"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-autotuning-"))
    workload = root / "workload.py"
    workload.write_text(WORKLOAD)
    runs = []
    ours = [sys.executable, "-m", "shardwise.cli", "run", "--autotuning", "run", "--nproc", str(args.nproc)]
    ds_bin = str(Path(args.ds_python).parent)
    theirs = [f"{ds_bin}/deepspeed", "--autotuning", "run", "--num_gpus", str(args.nproc)]
    for name, launcher, path_dir in (
        ("shardwise", ours, str(Path(sys.executable).parent)),
        ("deepspeed", theirs, ds_bin),
    ):
        folder = root / f"tuned-by-{name}"  # not "deepspeed": the script's folder is on its sys.path
        folder.mkdir()
        (folder / "ds_config.json").write_text(json.dumps(_config(args, folder)))
        command = [*launcher, str(workload), "--deepspeed", "--deepspeed_config", str(folder / "ds_config.json")]
        run = _tune(name, command + _script_args(args), folder, args.timeout, path_dir=path_dir)
        run["throughput"] = _measure(run["chosen"], workload, args, folder / "measure") if run["chosen"] else None
        runs.append(run)
    lines = [
        f"MLP width {args.width} x {args.layers} layers, {args.nproc} CPU ranks, stages {args.stages}, "
        f"micro-batch <= {args.max_micro}",
        "",
        "| tuner | exit | tuning wall s | chosen | chosen's throughput (samples/s, shardwise engine) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        value = f"{run['throughput']:.1f}" if run["throughput"] else "n/a"
        lines.append(f"| {run['name']} | {run['code']} | {run['seconds']:.1f} | {_describe(run['chosen'])} | {value} |")
    lines += ["", *(f"- {run['name']} output tail: {run['tail']}" for run in runs)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
