"""Dynamic batching on variable-length data: training samples/s of token-budget micro-batches
(``variable_batch_size_and_lr``) against fixed-size micro-batches padded to the longest
sample (issue 34)::

    python bench/bench_dynamic_batching.py --out bench/results/<date>-cpu-dynamic-batching.md

Workload: a small causal decoder (vocab 1024, width 256, 2 pre-LN blocks, 4 heads, SDPA),
fp32, SGD, one thread. ``--samples`` sequences with lengths drawn log-normally (median
about 48 tokens) and capped at ``--max-len`` (one sample is that long). One epoch per
variant and round; variants alternate within a round, odd rounds in reverse order; the
table gives the median samples/s over ``--rounds`` rounds, the min-max spread, the tokens
computed per sample (padding included) and the ratio to ``pad-batch``.

Variants (micro-batch ``--micro-batch`` samples, or ``max_tokens = micro-batch * median
length * 2`` tokens for the dynamic ones; every micro-batch padded to its own longest):

- ``pad-longest``: fixed micro-batches, every one padded to the dataset's longest sample
  (one static shape, what a compiled or pipelined model needs).
- ``pad-batch``: fixed micro-batches in dataset order, padded to the batch's longest.
- ``dynamic``: ``batch_by_seqlens`` in dataset order.
- ``dynamic-seqlen``: ``batch_by_seqlens`` with ``sequence_picking_order="seqlen"``
  (similar lengths together, the least padding).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import batch_by_seqlens

VOCAB, WIDTH, LAYERS, HEADS = 1024, 256, 2, 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.mlp(self.ln2(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), *[_Block() for _ in range(LAYERS)], nn.Linear(WIDTH, VOCAB))


def _lengths(num: int, max_len: int) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(num, generator=gen) * 0.8 + 3.9).clamp(2, max_len).long()
    lengths[num // 2] = max_len
    return lengths.tolist()


def _plans(lengths, micro_batch) -> dict[str, list[tuple[list[int], int]]]:
    """Per variant, the micro-batches as (sample ids, padded length)."""
    ids = list(range(len(lengths)))
    fixed = [ids[i : i + micro_batch] for i in range(0, len(ids), micro_batch)]
    budget = micro_batch * int(statistics.median(lengths)) * 2
    plans = {
        "pad-longest": [(mb, max(lengths)) for mb in fixed],
        "pad-batch": [(mb, max(lengths[i] for i in mb)) for mb in fixed],
    }
    for name, order in (("dynamic", "dataloader"), ("dynamic-seqlen", "seqlen")):
        microbatches, _, _ = batch_by_seqlens(lengths, max(budget, max(lengths)), sequence_picking_order=order)
        plans[name] = [(mb, max(lengths[i] for i in mb)) for _, mb in microbatches]
    return plans


def _epoch(model, optimizer, tokens, plan) -> float:
    start = time.perf_counter()
    for ids, padded in plan:
        batch = tokens[ids, : padded + 1]
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = _lengths(args.samples, args.max_len)
    tokens = torch.randint(0, VOCAB, (args.samples, args.max_len + 1), generator=torch.Generator().manual_seed(1))
    plans = _plans(lengths, args.micro_batch)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    _epoch(model, optimizer, tokens, plans["pad-batch"][:4])  # warm-up
    times: dict[str, list[float]] = {name: [] for name in plans}
    for r in range(args.rounds):
        for name in plans if r % 2 == 0 else reversed(list(plans)):
            times[name].append(_epoch(model, optimizer, tokens, plans[name]))
    rows = [
        "| variant | micro-batches | samples | tokens/sample (padded) | samples/s median | min-max | vs pad-batch |",
        "|---|---|---|---|---|---|---|",
    ]
    base = statistics.median(times["pad-batch"]) / sum(len(ids) for ids, _ in plans["pad-batch"])
    for name, plan in plans.items():
        count = sum(len(ids) for ids, _ in plan)
        rates = [count / t for t in times[name]]
        padded = sum(len(ids) * length for ids, length in plan) / count
        speedup = base / (statistics.median(times[name]) / count)
        rows.append(
            f"| {name} | {len(plan)} | {count} | {padded:.1f} | {statistics.median(rates):.1f} | "
            f"{min(rates):.1f}-{max(rates):.1f} | {speedup:.2f}x |"
        )
    header = (
        f"samples {args.samples}, mean length {sum(lengths) / len(lengths):.1f}, longest {max(lengths)}, "
        f"micro-batch {args.micro_batch}, rounds {args.rounds}, torch {torch.__version__}, 1 thread"
    )
    text = "\n".join([header, "", *rows])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            title = "# Dynamic batching on variable-length data (CPU)"
            f.write(f"{title}\n\n`python bench/bench_dynamic_batching.py`\n\n{text}\n")


if __name__ == "__main__":
    main()
