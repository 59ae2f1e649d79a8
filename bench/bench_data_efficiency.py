"""Time to a target validation loss with the data-efficiency features (issue 34).

The demo GPT (``examples/gpt_model.py``) on the demo's data (the Python standard library's
source as bytes) trains through ``shardwise.initialize`` on one rank, one thread, until its
validation loss (held-out blocks at the end of the corpus, full length, evaluated every
``--eval-every`` steps) is at or below ``--target``. Variants, each a config section on the
same model, data order, seed and learning-rate schedule:

- ``baseline``: none of them;
- ``seqlen``: the legacy ``curriculum_learning`` (seqlen, ``fixed_linear`` from
  ``--seqlen-min`` to the full length over ``--seqlen-steps`` steps; the model cuts its
  batch to ``curriculum_seqlen``);
- ``ltd``: ``data_efficiency.data_routing.random_ltd`` on every block but the first and last,
  kept tokens from ``--ltd-min`` to the full length over ``--ltd-steps`` steps;
- ``both``: the two together.

Each run is its own process (``--worker``); the variants alternate within a round and odd
rounds go in reverse order (``--concurrent``: a round's variants run side by side, so each
sees the same load, for a machine too loaded to run them one after another). A run's
clock counts training steps only (evaluation is excluded: every variant would pay it
alike per evaluation); its process CPU time is reported beside the wall time, the
steadier figure on a shared machine (one thread: CPU time is the compute it needed)::

    python bench/bench_data_efficiency.py --rounds 2 --out bench/results/<date>-cpu-data-efficiency.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("baseline", "seqlen", "ltd", "both")


def _config(args, variant: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": 20, "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
    }  # fmt: skip
    if variant in ("seqlen", "both"):
        config["curriculum_learning"] = {
            "enabled": True,
            "curriculum_type": "seqlen",
            "min_difficulty": args.seqlen_min,
            "max_difficulty": args.seq,
            "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": args.seqlen_steps, "difficulty_step": 8},
        }
    if variant in ("ltd", "both"):
        config["data_efficiency"] = {
            "enabled": True,
            "seed": args.seed,
            "data_routing": {
                "enabled": True,
                "random_ltd": {
                    "enabled": True,
                    "total_layer_num": args.layers,
                    "random_ltd_layer_num": args.layers - 2,
                    "random_ltd_layer_id": list(range(1, args.layers - 1)),
                    "model_mask_name": None,
                    "model_type": "decoder",
                    "hidden_state_order": "batch_seq_dim",
                    "random_ltd_schedule": {
                        "min_value": args.ltd_min,
                        "max_value": args.seq,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"require_steps": args.ltd_steps, "seq_per_step": 16},
                    },
                },
            },
        }
    return config


def _worker(args) -> None:
    """Train one variant to the target; print one JSON line."""
    sys.path.insert(0, str(REPO / "examples"))
    from gpt_model import GPT, Block, GPTConfig, byte_corpus

    import shardwise
    from shardwise.runtime.data_pipeline.data_routing import convert_to_random_ltd

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    corpus = byte_corpus(max_bytes=args.corpus_bytes)
    blocks = corpus[: (corpus.numel() - 1) // args.seq * args.seq + 1]
    starts = torch.arange(0, blocks.numel() - args.seq, args.seq)
    train_starts, val_starts = starts[: -args.val_blocks], starts[-args.val_blocks :]  # held out: the end

    def batch(offsets):
        windows = torch.stack([blocks[s : s + args.seq + 1] for s in offsets.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]

    val_x, val_y = batch(val_starts)
    model = GPT(GPTConfig(vocab_size=256, width=args.width, num_layers=args.layers, num_heads=args.heads,
                          seq_len=args.seq))  # fmt: skip
    if args.worker in ("ltd", "both"):
        model = convert_to_random_ltd(model, Block)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(args, args.worker))  # fmt: skip
    order = torch.Generator().manual_seed(args.seed)  # the same batches for every variant

    def validate() -> float:
        engine.eval()
        with torch.no_grad():
            losses = [engine(val_x[i : i + 16], val_y[i : i + 16]).item() for i in range(0, len(val_x), 16)]
        engine.train()
        return sum(losses) / len(losses)

    wall = cpu = 0.0
    history = []
    reached = None
    while engine.global_steps < args.max_steps:
        x, y = batch(train_starts[torch.randint(len(train_starts), (args.batch,), generator=order)])
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        wall += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
        if engine.global_steps % args.eval_every == 0:
            history.append((engine.global_steps, round(wall, 2), round(cpu, 2), round(validate(), 4)))
            print(args.worker, *history[-1], file=sys.stderr, flush=True)
            if history[-1][3] <= args.target:
                reached = history[-1]
                break
    print(json.dumps({"variant": args.worker, "reached": reached, "history": history}), flush=True)


def _start(args, variant: str) -> subprocess.Popen:
    command = [sys.executable, __file__, "--worker", variant] + [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in ("worker", "out", "rounds", "logs", "variants", "concurrent")
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu")
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen, variant: str) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _reached(history: list, target: float):
    """The first evaluation ``(step, wall, cpu, loss)`` at or below ``target``; None if none."""
    return next((h for h in history if h[3] <= target), None)


def _table(results: dict[str, list[dict]], target: float, eval_every: int) -> str:
    def med(values):
        values = list(values)
        return statistics.median(values) if values else float("nan")

    hits = {v: [_reached(r["history"], target) for r in runs] for v, runs in results.items()}
    base = [h for h in hits["baseline"] if h]
    base_wall, base_cpu = med(h[1] for h in base), med(h[2] for h in base)
    lines = [
        f"target validation loss {target} (evaluated every {eval_every} steps)",
        "",
        "| variant | reached | steps | train CPU s (median; rounds) | train wall s (median; rounds) "
        "| CPU time saving (baseline / variant) | wall saving |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant, runs in hits.items():
        got = [h for h in runs if h]
        steps, wall, cpu = (med(h[i] for h in got) for i in range(3))

        def each(i, runs=runs):
            return ", ".join(f"{h[i]:.1f}" if h else "not reached" for h in runs)

        lines.append(
            f"| {variant} | {len(got)}/{len(runs)} | {steps:.0f} | {cpu:.1f} ({each(2)}) | {wall:.0f} ({each(1)}) "
            f"| {base_cpu / cpu:.2f}x | {base_wall / wall:.2f}x |"
        )
    return "\n".join(lines)


def _read_logs(paths: list[str]) -> dict[str, list[dict]]:
    """Histories from workers' progress lines (``variant step wall cpu loss`` on stderr):
    a run cut short still gives the evaluations it made. ``label=path`` files the run under
    ``label`` instead of its variant (another schedule of the same variant)."""
    results: dict[str, list[dict]] = {}
    for entry in paths:
        label, _, path = entry.rpartition("=")
        history, variant = [], None
        for line in Path(path).read_text().splitlines():
            parts = line.split()
            if len(parts) == 5 and parts[0] in VARIANTS:
                variant = parts[0]
                history.append((int(parts[1]), float(parts[2]), float(parts[3]), float(parts[4])))
        if variant is not None:
            results.setdefault(label or variant, []).append({"variant": variant, "history": history})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--target", type=float, default=1.9, help="validation loss to reach (nats per byte)")
    parser.add_argument("--max-steps", type=int, default=1500)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--val-blocks", type=int, default=64, help="blocks at the corpus end held out")
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--seqlen-min", type=int, default=32)
    parser.add_argument("--seqlen-steps", type=int, default=100)
    parser.add_argument("--ltd-min", type=int, default=128)
    parser.add_argument("--ltd-steps", type=int, default=200)
    parser.add_argument("--out", default=None, help="append the markdown table to this file")
    parser.add_argument(
        "--concurrent", action="store_true", help="run a round's variants at the same time (a loaded machine)"
    )
    parser.add_argument("--logs", nargs="*", default=None, help="tabulate these workers' progress logs instead")
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    if args.logs:
        return print(_table(_read_logs(args.logs), args.target, args.eval_every))
    variants = args.variants.split(",")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        if args.concurrent:  # the round's variants side by side: the same load for each
            procs = {variant: _start(args, variant) for variant in order}
            done = {variant: _finish(proc, variant) for variant, proc in procs.items()}
        for variant in order:
            result = done[variant] if args.concurrent else _finish(_start(args, variant), variant)
            results[variant].append(result)
            load.append(os.getloadavg()[0])
            print(f"round {r} {variant}: reached {result['reached']} (load {load[-1]:.1f})", flush=True)
    table = (
        _table(results, args.target, args.eval_every)
        + f"\n\n(load average, 1 min, during the runs: {min(load):.1f}-{max(load):.1f})\n"
    )
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n")
        with open(Path(args.out).with_suffix(".json"), "a") as f:
            f.write(json.dumps({"args": vars(args), "results": results}) + "\n")


if __name__ == "__main__":
    main()
