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
rounds go in reverse order. A run's clock counts training steps only (evaluation is
excluded: every variant would pay it alike per evaluation); its process CPU time is
reported beside the wall time, the steadier figure on a shared machine::

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


def _run(args, variant: str) -> dict:
    command = [sys.executable, __file__, "--worker", variant] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("worker", "out", "rounds")
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu")
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(results: dict[str, list[dict]], args) -> str:
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else float("nan")

    base = {key: med(r["reached"][i] if r["reached"] else None for r in results["baseline"])
            for key, i in (("steps", 0), ("wall", 1), ("cpu", 2))}  # fmt: skip
    lines = [
        f"target validation loss {args.target} (evaluated every {args.eval_every} steps)",
        "",
        "| variant | reached | steps (median) | train wall s (median, rounds) | train CPU s (median) "
        "| wall saving (baseline / variant) | CPU saving |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant, runs in results.items():
        hits = [r["reached"] for r in runs]
        got = [h for h in hits if h]
        steps, wall, cpu = (med(h[i] for h in got) for i in range(3))
        walls = ", ".join(f"{h[1]:.0f}" if h else "not reached" for h in hits)
        lines.append(
            f"| {variant} | {len(got)}/{len(hits)} | {steps:.0f} | {wall:.1f} ({walls}) | {cpu:.1f} "
            f"| {base['wall'] / wall:.2f}x | {base['cpu'] / cpu:.2f}x |"
        )
    return "\n".join(lines)


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
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    variants = args.variants.split(",")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            result = _run(args, variant)
            results[variant].append(result)
            load.append(os.getloadavg()[0])
            print(f"round {r} {variant}: reached {result['reached']} (load {load[-1]:.1f})", flush=True)
    table = _table(results, args) + f"\n\n(load average, 1 min, during the runs: {min(load):.1f}-{max(load):.1f})\n"
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n")
        with open(Path(args.out).with_suffix(".json"), "a") as f:
            f.write(json.dumps({"args": vars(args), "results": results}) + "\n")


if __name__ == "__main__":
    main()
