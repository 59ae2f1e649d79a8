"""``shardwise run --autotuning run`` against DeepSpeed 0.19.8's ``deepspeed --autotuning run``
on the same script and config: tuning wall time, what each chose, and the chosen
configurations' throughput measured the same way afterwards.

The workload (written to a temporary folder) is ``--model gpt`` (examples/gpt_model.py's GPT,
byte vocabulary, ``--width``, ``--layers``, ``--seq``: steps of tens to hundreds of ms on one
CPU thread) or ``--model mlp`` (an MLP, ``--width`` x ``--layers``), trained with a torch
AdamW the script passes to ``initialize`` (so DeepSpeed JIT-builds no optimizer op) on random
batches; it imports ``deepspeed`` where that is installed (DeepSpeed's environment,
``--ds-python``) and shardwise otherwise, and takes the config through ``--deepspeed
--deepspeed_config PATH`` as DeepSpeed's tuner expects. Both tuners get the same
``autotuning`` section (``--stages``, micro-batch bounds, ``--profile START,END``).
Each tuner runs ``--repeat`` times, alternating (A B, then B A; median wall times). Then the
first choice of each is run ``--rounds`` times, alternating, under
shardwise's engine in profile mode (steps 3..12, same script, same ranks) and their medians
compared on one yardstick::

    python bench/bench_autotuning.py --out bench/results/<date>-cpu-autotuning-gpt.md
    # the earlier MLP run (bench/results/2026-11-28-cpu-autotuning.md)
    python bench/bench_autotuning.py --model mlp --width 64 --layers 2 --stages 0,1 --max-micro 2 --profile 2,4

A tuner that fails, or is still running after ``--timeout`` (its whole process tree is then
killed), is reported with its exit code and the tail of its output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardwise.autotuning._experiment import kill_tree

WORKLOAD = """
import argparse, os, sys
import torch
try:
    import deepspeed
except ImportError:
    import shardwise as deepspeed
parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--model", default="gpt")
parser.add_argument("--examples", default="")
parser.add_argument("--width", type=int, default=128)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--seq", type=int, default=128)
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()
torch.manual_seed(0)
if args.model == "gpt":
    sys.path.insert(0, args.examples)
    from gpt_model import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=256, width=args.width, num_layers=args.layers, num_heads=4, seq_len=args.seq)
    model = GPT(cfg)
else:
    blocks = [torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.GELU()) for _ in range(args.layers)]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(args.width, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
engine, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer)
micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
for _ in range(args.steps * gas):
    if args.model == "gpt":
        tokens = torch.randint(0, 256, (micro, args.seq))
        loss = engine(tokens, tokens)
    else:
        loss = engine(torch.randn(micro, args.width)).square().mean()
    engine.backward(loss)
    engine.step()
"""


def _config(args, results: Path) -> dict:
    start, end = (int(v) for v in args.profile.split(","))
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "zero_optimization": {"stage": [int(s) for s in args.stages.split(",")]},
        "autotuning": {
            "enabled": True,
            "fast": True,
            "start_profile_step": start,
            "end_profile_step": end,
            "results_dir": str(results / "autotuning_results"),
            "exps_dir": str(results / "autotuning_exps"),
            "max_train_micro_batch_size_per_gpu": args.max_micro,
            "num_tuning_micro_batch_sizes": 3,
        },
    }


def _env(path_dir: str, *, pythonpath: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDWISE_ACCELERATOR": "cpu", "DS_ACCELERATOR": "cpu"}
    env["PATH"] = f"{path_dir}{os.pathsep}{env.get('PATH', '')}"  # DeepSpeed's tuner runs `deepspeed` from PATH
    if not pythonpath:
        env.pop("PYTHONPATH", None)  # DeepSpeed's run: examples/gpt_model.py then finds no shardwise
    return env


def _tune(name: str, command: list[str], cwd: Path, timeout_s: float, *, env: dict) -> dict:
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
    results = cwd / "autotuning_results"
    optimal = results / "ds_config_optimal.json"
    chosen = json.loads(optimal.read_text()) if optimal.is_file() else None
    experiments = sorted(p.parent.name for p in results.glob("*/ds_config.json")) if results.is_dir() else []
    tail = " | ".join(str(output).strip().splitlines()[-6:])
    return {"name": name, "code": code, "seconds": seconds, "chosen": chosen, "tail": tail, "experiments": experiments}


def _measure(config: dict, workload: Path, args, folder: Path) -> float | None:
    """Throughput of ``config`` under shardwise's engine in profile mode (samples/s)."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "metrics.json"
    metrics.unlink(missing_ok=True)
    config = {**config, "autotuning": {"enabled": True, "start_profile_step": 3, "end_profile_step": 12,
                                       "metric_path": str(metrics)}}  # fmt: skip
    (folder / "ds_config.json").write_text(json.dumps(config))
    command = [sys.executable, "-m", "shardwise.cli", "run", "--nproc", str(args.nproc), str(workload),
               "--deepspeed", "--deepspeed_config", str(folder / "ds_config.json"), *_script_args(args),
               "--steps", "20"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDWISE_ACCELERATOR": "cpu"}
    subprocess.run(command, cwd=folder, env=env, capture_output=True, timeout=args.timeout)
    return json.loads(metrics.read_text())["throughput"] if metrics.is_file() else None


def _script_args(args) -> list[str]:
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    return ["--model", args.model, "--examples", examples, "--width", str(args.width), "--layers", str(args.layers),
            "--seq", str(args.seq)]  # fmt: skip


def _describe(config: dict | None) -> str:
    if config is None:
        return "none"
    zero = config.get("zero_optimization", {})
    micro, gas = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps")
    return f"stage {zero.get('stage')}, micro-batch {micro}, accumulation {gas}"


def _compare(runs: list[dict], workload: Path, args, root: Path) -> list[str]:
    """The chosen configs measured in alternating rounds: one line per round, then medians."""
    chosen = list({run["name"]: run for run in reversed(runs) if run["chosen"]}.values())[::-1]  # each's first
    samples: dict[str, list[float]] = {run["name"]: [] for run in chosen}
    for index in range(args.rounds):
        for run in chosen if index % 2 == 0 else chosen[::-1]:
            value = _measure(run["chosen"], workload, args, root / f"measure-{run['name']}")
            if value is not None:
                samples[run["name"]].append(value)
    for run in chosen:
        values = samples[run["name"]]
        run["throughput"] = statistics.median(values) if values else None
        run["samples"] = values
    return [f"- {name}'s choice, each round (samples/s): {', '.join(f'{v:.2f}' for v in values)}"
            for name, values in samples.items()]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "mlp"], default="gpt")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128, help="tokens per sample (gpt)")
    parser.add_argument("--stages", default="0,1,2")
    parser.add_argument("--max-micro", type=int, default=8)
    parser.add_argument("--profile", default="3,5", help="start_profile_step,end_profile_step (DeepSpeed's defaults)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating measurements of each choice")
    parser.add_argument("--tuners", default="shardwise,deepspeed")
    parser.add_argument("--repeat", type=int, default=2, help="tuning runs of each tuner, alternating")
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
    ds_bin = str(Path(args.ds_python).parent)
    tuners = {
        "shardwise": ([sys.executable, "-m", "shardwise.cli", "run", "--autotuning", "run", "--nproc", str(args.nproc)],
                      _env(str(Path(sys.executable).parent), pythonpath=True)),
        "deepspeed": ([f"{ds_bin}/deepspeed", "--autotuning", "run", "--num_gpus", str(args.nproc)],
                      _env(ds_bin, pythonpath=False)),
    }  # fmt: skip
    runs = []
    names = args.tuners.split(",")
    for repeat in range(args.repeat):  # alternating: A B, then B A
        for name in names if repeat % 2 == 0 else names[::-1]:
            launcher, env = tuners[name]
            folder = root / f"tuned-by-{name}-{repeat}"  # not "deepspeed": the script's folder is on its sys.path
            folder.mkdir()
            (folder / "ds_config.json").write_text(json.dumps(_config(args, folder)))
            command = [*launcher, str(workload), "--deepspeed", "--deepspeed_config", str(folder / "ds_config.json")]
            runs.append(_tune(name, command + _script_args(args), folder, args.timeout, env=env))
            print(
                f"{name}: {runs[-1]['seconds']:.1f} s, exit {runs[-1]['code']}, {_describe(runs[-1]['chosen'])}",
                flush=True,
            )
    rounds = _compare(runs, workload, args, root)
    shape = f"GPT width {args.width} x {args.layers} layers, seq {args.seq}" if args.model == "gpt" else (
        f"MLP width {args.width} x {args.layers} layers")  # fmt: skip
    lines = [
        f"{shape}, {args.nproc} CPU rank(s), stages {args.stages}, micro-batch <= {args.max_micro}, "
        f"profile steps {args.profile}",
        "",
        "| tuner | exit | tuning wall s | experiments run | chosen | chosen's throughput, median (samples/s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        value = f"{run['throughput']:.2f}" if run.get("throughput") else "(its first run's choice is measured)"
        lines.append(
            f"| {run['name']} | {run['code']} | {run['seconds']:.1f} | {', '.join(run['experiments'])} | "
            f"{_describe(run['chosen'])} | {value} |"
        )
    medians = {name: statistics.median(r["seconds"] for r in runs if r["name"] == name) for name in names}
    lines += ["", "- median tuning wall s: " + ", ".join(f"{n} {v:.1f}" for n, v in medians.items())]
    lines += [*rounds, *(f"- {run['name']} output tail: {run['tail']}" for run in runs)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
