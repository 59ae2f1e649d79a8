"""Random-LTD step time against the full step: one process, a small GPT, alternated rounds.

The same GPT-like decoder (pre-LN blocks, causal SDPA attention, tied-free LM head, AdamW)
trains two ways from the same weights and batches:

- ``full``: every layer on every token;
- ``ltd``: ``shardwise.runtime.data_pipeline.data_routing``'s random-LTD on all layers
  but the first and last, the kept length held at ``--kept`` tokens (a schedule whose ramp
  never moves in the measured steps).

Each round times ``--steps`` steps of each (after ``--warmup`` untimed ones), one step of
each by turns, the first variant alternating between rounds; the report gives per-round medians, the median over rounds
and the ``ltd / full`` ratio of each round. The FLOP ratio of the two forward passes is
printed beside it: the best a perfect gather/scatter could do::

    OMP_NUM_THREADS=1 python bench/bench_random_ltd.py --out bench/results/<date>-cpu-random-ltd.md
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from datetime import date

import torch
from _machine import cpu_model  # this folder is on sys.path when run as a script
from torch import nn

from shardwise.runtime.data_pipeline.data_routing import RandomLTD, convert_to_random_ltd


class Block(nn.Module):
    """Pre-LN decoder block: causal SDPA attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.width)
        self.pos = nn.Embedding(args.seq, args.width)
        self.blocks = nn.ModuleList(Block(args.width, args.heads) for _ in range(args.layers))
        self.ln = nn.LayerNorm(args.width)
        self.head = nn.Linear(args.width, args.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.size(1)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _section(args) -> dict:
    return {
        "enabled": True,
        "total_layer_num": args.layers,
        "random_ltd_layer_num": args.layers - 2,
        "random_ltd_layer_id": list(range(1, args.layers - 1)),
        "model_mask_name": None,
        "model_type": "decoder",
        "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {
            "min_value": args.kept,
            "max_value": args.seq,
            "schedule_type": "fixed_linear",
            "schedule_config": {"require_steps": 10**9, "seq_per_step": 16},
        },
    }


def _forward_flops(args, kept_layers: int, kept: int) -> float:
    """Multiply-adds x 2 of one forward: the blocks' linears and attention, and the head."""
    tokens = args.batch * args.seq

    def block(n):
        return 2 * args.batch * (12 * n * args.width**2 + 2 * n * n * args.width)

    full_layers = args.layers - kept_layers
    return full_layers * block(args.seq) + kept_layers * block(kept) + 2 * tokens * args.width * args.vocab


def _step(model, optimizer, tokens) -> tuple[float, float]:
    """One training step; its wall and process CPU seconds."""
    start, cpu = time.perf_counter(), time.process_time()
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, time.process_time() - cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--kept", type=int, default=256, help="tokens kept per sample in the LTD layers")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="append the markdown table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    full = GPT(args)
    ltd = convert_to_random_ltd(copy.deepcopy(full), Block)
    ltd_state = RandomLTD.from_config(_section(args), ltd, global_batch_size=args.batch)
    assert ltd_state.layers[0].kept_length == args.kept
    models = {"full": full, "ltd": ltd}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=3e-4) for name, m in models.items()}
    batches = [torch.randint(args.vocab, (args.batch, args.seq + 1)) for _ in range(args.warmup + args.steps)]

    load_before = os.getloadavg()[0]
    rounds = []
    for r in range(args.rounds):
        order = ["full", "ltd"] if r % 2 == 0 else ["ltd", "full"]
        times = {name: [] for name in order}
        for tokens in batches:  # the two variants step by turns, so both see the same load
            for name in order:
                times[name].append(_step(models[name], optimizers[name], tokens))
        medians = {name: statistics.median(w for w, _ in t[args.warmup :]) for name, t in times.items()}
        medians |= {f"{name} cpu": statistics.median(c for _, c in t[args.warmup :]) for name, t in times.items()}
        rounds.append(medians)
        print(
            f"round {r}: full {medians['full']:.3f} s, ltd {medians['ltd']:.3f} s, "
            f"ratio {medians['ltd'] / medians['full']:.3f} (CPU time {medians['ltd cpu'] / medians['full cpu']:.3f})",
            flush=True,
        )
    _report(args, rounds, load_before)


def _summary(rounds, key: str) -> tuple[str, float, str]:
    """The median over rounds of ``key``'s per-round medians, and those listed."""
    values = [r[key] for r in rounds]
    return key, statistics.median(values), ", ".join(f"{v:.3f}" for v in values)


def _report(args, rounds, load_before):
    flop_ratio = _forward_flops(args, args.layers - 2, args.kept) / _forward_flops(args, 0, args.seq)
    for r in rounds:
        r["ratio"], r["ratio cpu"] = r["ltd"] / r["full"], r["ltd cpu"] / r["full cpu"]
    rows = [_summary(rounds, key) for key in ("full", "ltd", "full cpu", "ltd cpu", "ratio", "ratio cpu")]
    lines = [
        f"{date.today()} | {cpu_model()} ({os.cpu_count()} cores) | torch {torch.__version__} | "
        f"{args.threads} thread(s) | load average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}",
        "",
        f"GPT {args.layers} layers, width {args.width}, {args.heads} heads, seq {args.seq}, batch {args.batch}, "
        f"vocab {args.vocab}; random-LTD on layers 1..{args.layers - 2} at {args.kept} kept tokens; "
        f"{args.rounds} rounds x {args.steps} timed steps (after {args.warmup} warm-up) per variant, by turns",
        "",
        "| step time | median over rounds | per-round medians |",
        "| --- | --- | --- |",
        *(f"| {key} | {median:.3f} | {values} |" for key, median, values in rows),
        "",
        f"(seconds; `ratio` = random-LTD / full per round, wall and process CPU time; forward FLOP ratio "
        f"{flop_ratio:.3f}, the bound for a free gather and scatter)",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as out:
            out.write(text + "\n\n")


if __name__ == "__main__":
    main()
