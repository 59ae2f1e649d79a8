"""Optimizer step throughput on the CPU: torch AdamW (for-loop, foreach, fused), shardwise's
``DeepSpeedCPUAdam`` and DeepSpeed's compiled ``DeepSpeedCPUAdam``, in one run.

Every variant steps the same fp32 parameters (``--numel`` elements in transformer-shaped
tensors) with the same fixed random gradients, lr 1e-3, weight decay 0.01 (decoupled),
default betas and eps. Each run makes 2 warm-up steps (they create the optimizer state) and
then times ``--steps`` steps; the variants run in turn, ``--repeats`` rounds, the order
shuffled after the first round. The table reports the median over rounds of each round's median step
time, parameters/s, ratios, and the largest difference of the final parameters from
``torch-forloop`` (round 1), which shows the variants compute the same update.

The machine may be shared: each run waits until the CPUs are idle, measures the CPU time
other processes took during its timed steps (from /proc/stat), and is repeated when that
exceeded ``--max-other`` of the cores; the table shows the worst share that was let through.

    python bench/bench_cpu_adam.py --out bench/results/<date>-cpu-adam.md
    python bench/bench_cpu_adam.py --numel 2000000 --steps 3 --repeats 1   # a quick smoke run

DeepSpeed runs in its own interpreter (``--ds-python``), through ``--worker deepspeed``,
so it is never a dependency of shardwise; its op is JIT-built once before timing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from _machine import cpu_model  # this folder is on sys.path when run as a script

VARIANTS = "torch-forloop,torch-foreach,torch-fused,shardwise,deepspeed-cpuadam"
LR, WEIGHT_DECAY = 1e-3, 0.01
RESULT_TAG = "BENCH_RESULT "  # marks the worker's JSON line among DeepSpeed's log lines


# -- contention: CPU time of other processes -------------------------------------------------


def _machine_busy_seconds() -> float:
    """CPU seconds all processes (and the hypervisor, as steal) have used since boot."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return float("nan")  # not Linux: contention is not measured
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process, all its threads."""
    t = os.times()
    return t.user + t.system


def wait_until_idle(threshold: float, timeout: float) -> None:
    """Waits (up to ``timeout`` seconds) for a one-second window in which the machine's
    CPUs are busy less than ``threshold`` of the time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = _machine_busy_seconds()
        time.sleep(1.0)
        if not (_machine_busy_seconds() - busy) / os.cpu_count() >= threshold:  # nan: not measured
            return
    print(f"  machine still busy after {timeout:.0f} s, running anyway", file=sys.stderr, flush=True)


# -- workload: shared by the driver and the DeepSpeed worker -------------------------------


def layout(numel: int) -> list[tuple[int, ...]]:
    """Tensor shapes like a GPT with hidden size d: per block qkv, attention projection, two
    MLP matrices, their biases and two layer norms; then an embedding matrix and one vector
    take what is left, so the shapes sum to exactly ``numel``."""
    d = 1024
    while d > 16 and 24 * d * d > numel:  # at least two blocks' worth of elements
        d //= 2
    block = [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    block_numel = sum(torch.Size(s).numel() for s in block)
    shapes = block * (numel // block_numel)
    rest = numel - len(shapes) // len(block) * block_numel
    if rest // d:
        shapes.append((rest // d, d))
    if rest % d:
        shapes.append((rest % d,))
    return shapes


def make_workload(numel: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Initial parameters (std 0.02) and gradients (std 0.01), the same in every process for
    the same torch version: drawn in a fixed order from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    shapes = layout(numel)
    params = [torch.empty(s).normal_(0.0, 0.02, generator=generator) for s in shapes]
    grads = [torch.empty(s).normal_(0.0, 0.01, generator=generator) for s in shapes]
    return params, grads


def time_steps(optimizer, warmup: int, steps: int) -> dict:
    """Runs ``warmup`` untimed steps, then times ``steps`` steps. Returns {"times": seconds of
    each, "other": share of the CPUs that other processes used meanwhile}."""
    for _ in range(warmup):
        optimizer.step()
    times = []
    busy, own, start = _machine_busy_seconds(), _own_seconds(), time.perf_counter()
    for _ in range(steps):
        step_start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - step_start)
    # at least 1 s in the denominator: /proc/stat counts in clock ticks (10 ms)
    other = (_machine_busy_seconds() - busy - (_own_seconds() - own)) / (
        max(time.perf_counter() - start, 1.0) * os.cpu_count()
    )
    return {"times": times, "other": other if math.isnan(other) else max(other, 0.0)}


def fresh_params(initial: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """New leaf parameters copied from ``initial``, each holding its gradient (the
    optimizers read gradients and never write them, so they are shared between runs)."""
    params = [torch.nn.Parameter(t.clone()) for t in initial]
    for p, g in zip(params, grads):
        p.grad = g
    return params


# -- worker: DeepSpeed's DeepSpeedCPUAdam, in the DeepSpeed interpreter --------------------


def worker(args) -> None:
    torch.set_num_threads(args.threads)  # also sets OpenMP's count, which cpu_adam's loops use
    from deepspeed.ops.op_builder import CPUAdamBuilder

    if args.build_only:  # JIT-compiles the op (cached under ~/.cache/torch_extensions)
        CPUAdamBuilder().load()
        import deepspeed

        print(RESULT_TAG + json.dumps({"version": deepspeed.__version__}), flush=True)
        return
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    initial, grads = make_workload(args.numel, args.seed)
    params = fresh_params(initial, grads)
    del initial
    optimizer = DeepSpeedCPUAdam(params, lr=LR, weight_decay=WEIGHT_DECAY)  # adamw_mode=True by default
    result = time_steps(optimizer, args.warmup, args.steps)
    if args.save:  # final parameters, for the numerics column
        torch.save(torch.cat([p.detach().reshape(-1) for p in params]), args.save)
    print(RESULT_TAG + json.dumps(result), flush=True)


def _run_worker(args, extra: list[str], timeout: float) -> dict:
    """Runs this script as a DeepSpeed worker; returns its JSON result or {"error": ...}."""
    if not Path(args.ds_python).exists():
        return {"error": f"DeepSpeed interpreter {args.ds_python} not found (see bench/README.md)"}
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(args.threads)}
    cmd = [
        args.ds_python,
        __file__,
        "--worker",
        "deepspeed",
        "--numel",
        str(args.numel),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
        *extra,
    ]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    lines = [ln for ln in (proc.stdout + proc.stderr).strip().splitlines() if ln.strip()]
    # the exception line, not the traceback's last frame or a trailing log line
    reason = next((ln for ln in reversed(lines) if "Error" in ln.split(":")[0]), lines[-1] if lines else "failed")
    return {"error": reason.strip()[:160]}


# -- driver ---------------------------------------------------------------------------------


def _optimizer(variant: str, params):
    if variant == "torch-forloop":
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=False, fused=False)
    if variant == "torch-foreach":
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    if variant == "torch-fused":
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    if variant == "shardwise":
        from shardwise.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=LR, weight_decay=WEIGHT_DECAY)
    raise ValueError(f"unknown variant {variant!r}")


def run_variant(args, variant: str, initial, grads, keep_final: bool) -> dict:
    """One run of one variant, repeated while other processes took more than ``--max-other``
    of the CPUs during it. Returns {"times": [...], "other": share} plus "final" (flat
    parameters) when ``keep_final``, or {"error": ...}."""
    for _ in range(args.retries + 1):
        wait_until_idle(args.max_other, args.idle_timeout)
        result = _run_once(args, variant, initial, grads, keep_final)
        if "error" in result or not result["other"] > args.max_other:  # nan (no /proc/stat) is accepted
            return result
        print(
            f"  other processes took {result['other']:.0%} of the CPUs while timing "
            f"({sum(result['times']):.2f} s), again",
            file=sys.stderr,
            flush=True,
        )
    return result  # the last attempt, contended: its share shows in the table


def _run_once(args, variant: str, initial, grads, keep_final: bool) -> dict:
    """Fresh parameters, warm-up, timed steps: in this process, or in a DeepSpeed worker."""
    if variant == "deepspeed-cpuadam":
        with tempfile.TemporaryDirectory() as tmp:
            save = Path(tmp) / "final.pt"
            result = _run_worker(args, ["--save", str(save)] if keep_final else [], args.timeout)
            if keep_final and "error" not in result:
                result["final"] = torch.load(save)
        return result
    params = fresh_params(initial, grads)
    optimizer = _optimizer(variant, params)
    result = time_steps(optimizer, args.warmup, args.steps)
    if keep_final:
        result["final"] = torch.cat([p.detach().reshape(-1) for p in params])
    return result


def _versions(ds_version: str | None) -> str:
    parts = [f"torch {torch.__version__}"]
    try:
        import shardwise

        parts.append(f"shardwise {getattr(shardwise, '__version__', '?')}")
    except ImportError:
        pass
    parts.append(f"deepspeed {ds_version or 'unavailable'}")
    return ", ".join(parts)


def table(args, variants: list[str], stats: dict, errors: dict, diffs: dict, ds_version) -> str:
    foreach = stats.get("torch-foreach", {}).get("median")
    deepspeed = stats.get("deepspeed-cpuadam", {}).get("median")
    n_tensors = len(layout(args.numel))
    lines = [
        f"# AdamW step throughput on the CPU, {args.numel / 1e6:g}M fp32 parameters in {n_tensors} tensors, "
        f"{args.threads} threads",
        "",
        f"{date.today()} | {cpu_model()} ({os.cpu_count()} cores) | {_versions(ds_version)} | "
        f"torch.set_num_threads({args.threads}) in every variant | median over {args.repeats} rounds of "
        f"the median of {args.steps} steps after {args.warmup} warm-up",
        "",
        "| variant | median s/step | min-max | params/s | speed vs torch-foreach | speed vs deepspeed-cpuadam "
        "| max abs diff vs torch-forloop | other CPU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant in variants:
        if variant in errors:
            lines.append(f"| {variant} | {errors[variant]} | | | | | | |")
            continue
        s = stats[variant]
        vs_foreach = f"{foreach / s['median']:.2f}" if foreach else "-"
        vs_ds = f"{deepspeed / s['median']:.2f}" if deepspeed else "-"
        diff = f"{diffs[variant]:.1e}" if variant in diffs else "-"
        lines.append(
            f"| {variant} | {s['median']:.4f} | {s['min']:.4f}-{s['max']:.4f} | "
            f"{args.numel / s['median'] / 1e6:.0f}M | {vs_foreach} | {vs_ds} | {diff} | "
            f"{s['other']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--numel", type=int, default=50_000_000, help="parameters in all tensors together")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (create the state)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all variants (shuffled after the first)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads everywhere")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ds-python", default=os.environ.get("DS_PYTHON", "/work/ds-env/bin/python"))
    parser.add_argument("--build-timeout", type=float, default=600, help="seconds for DeepSpeed's JIT build")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for one DeepSpeed worker run")
    parser.add_argument(
        "--max-other",
        type=float,
        default=0.05,
        help="repeat a run in which other processes took more than this share of the CPUs",
    )
    parser.add_argument("--retries", type=int, default=5, help="repeats of a contended run, at most")
    parser.add_argument("--idle-timeout", type=float, default=600, help="seconds to wait for idle CPUs per run")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    parser.add_argument("--worker", choices=["deepspeed"], help=argparse.SUPPRESS)
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    errors, ds_version = {}, None
    if "deepspeed-cpuadam" in variants:  # build (or load the cached build) once, before any timing
        print("building DeepSpeed's cpu_adam op ...", file=sys.stderr, flush=True)
        built = _run_worker(args, ["--build-only"], args.build_timeout)
        if "error" in built:
            errors["deepspeed-cpuadam"] = f"did not build: {built['error']}"
        ds_version = built.get("version")
    initial, grads = make_workload(args.numel, args.seed)
    times: dict[str, list[float]] = {v: [] for v in variants}  # per-round medians
    others: dict[str, list[float]] = {v: [] for v in variants}  # other processes' CPU share per run
    finals = {}
    for round_ in range(args.repeats):
        order = list(variants)
        if round_:  # round 1 in the given order (torch-forloop first by default), then shuffled,
            random.Random(args.seed + round_).shuffle(order)  # so no variant always follows another
        for variant in order:
            if variant in errors:
                continue
            print(f"round {round_ + 1}: {variant} ...", file=sys.stderr, flush=True)
            result = run_variant(args, variant, initial, grads, keep_final=round_ == 0)
            if "error" in result:
                errors[variant] = f"error: {result['error']}"
                continue
            if "final" in result:
                finals[variant] = result.pop("final")
            times[variant].append(statistics.median(result["times"]))
            others[variant].append(result["other"])
            print(
                f"  median {times[variant][-1]:.4f} s/step, other processes {result['other']:.0%}",
                file=sys.stderr,
                flush=True,
            )
    stats = {
        v: {"median": statistics.median(t), "min": min(t), "max": max(t), "other": max(others[v])}
        for v, t in times.items()
        if t
    }
    reference = finals.get("torch-forloop")
    diffs = {v: (f - reference).abs().max().item() for v, f in finals.items() if reference is not None}
    text = table(args, variants, stats, errors, diffs, ds_version)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
