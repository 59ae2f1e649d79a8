"""Greedy decoding of a Mixtral-shaped MoE model on CPU: the model's own ``generate``
against shardwise's fast decoder (``init_inference(..., replace_with_kernel_inject=True)``,
[Note: the fast MoE MLP] in ``shardwise/inference/_fast_moe.py``), in one process.

The model is ``bench_inference.py``'s ``moe`` configuration (hidden 256, 4 layers, 4 / 2
heads, 8 experts of intermediate 512, top-2, vocab 8000, fp32, built from a config with
``torch.manual_seed(0)``; no end-of-sequence stop). For each batch size both sides
generate once to warm up, then alternately ``--repeats`` times (plain, fast, plain, ...),
each run started when the CPUs are idle; the table gives the medians, and the fast path's
tokens are checked against the plain model's. A second table times one MoE MLP of the
decoder on the decode step's tokens, both ways ([Note: the fast MoE MLP]): sorted by
expert (the CPU's choice) and every expert on every token (the sync-free form a CUDA
graph captures), beside the matmuls alone of the sorted way (its floor)::

    python bench/bench_moe_inference.py --out bench/results/<date>-cpu-moe-inference.md
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from datetime import date
from pathlib import Path

from _machine import cpu_model
from bench_inference import CONFIGS, build_model, prompts, wait_until_idle


def _time_generate(target, ids, new_tokens: int) -> tuple[float, list]:
    import torch

    wait_until_idle(0.15, 30)
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    elapsed = time.perf_counter() - start
    if out.shape[1] - ids.shape[1] != new_tokens:
        raise RuntimeError(f"{out.shape[1] - ids.shape[1]} new tokens, expected {new_tokens}")
    return elapsed, out.tolist()


def _time_mlp(mlp, batch: int, hidden: int, *, sync_free: bool, reps: int = 200) -> float:
    import torch

    x = torch.randn(batch, 1, hidden)
    mlp.sync_free = sync_free
    with torch.inference_mode():
        for _ in range(10):
            mlp(x)
        start = time.perf_counter()
        for _ in range(reps):
            mlp(x)
    return (time.perf_counter() - start) / reps


def _time_expert_matmuls(mlp, batch: int, hidden: int, reps: int = 200) -> float:
    """Seconds of the matmuls alone that one MoE MLP runs for ``batch`` tokens routed as
    the router routes random ones (each expert on its rows): the floor of the sorted way."""
    import torch

    from shardwise.inference._fast_moe import route

    x = torch.randn(batch, hidden)
    with torch.inference_mode():
        _, experts = route(torch.nn.functional.linear(x, mlp.router), mlp.routing)
        counts = torch.bincount(experts.reshape(-1), minlength=mlp.num_local).tolist()
        rows = {e: torch.randn(c, hidden) for e, c in enumerate(counts) if c}
        mids = {e: torch.randn(c, mlp.down.shape[1]) for e, c in enumerate(counts) if c}
        start = time.perf_counter()
        for _ in range(reps):
            for e in rows:
                rows[e] @ mlp.gate_up[e]
                mids[e] @ mlp.down[e]
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    import shardwise
    from shardwise.inference._fast_moe import MoEMLP

    torch.set_num_threads(args.threads)
    cfg = CONFIGS["moe"]
    plain = build_model(cfg, args.prompt_len + args.new_tokens + 8)
    engine = shardwise.init_inference(
        copy.deepcopy(plain), dtype=torch.float32, replace_with_kernel_inject=True, enable_cuda_graph=False
    )
    assert engine.fast_path
    rows, mlp_rows = [], []
    for batch in map(int, args.batches.split(",")):
        ids = prompts(cfg, batch, args.prompt_len)
        times = {"plain": [], "fast": []}
        tokens = {}
        for name, target in (("plain", plain), ("fast", engine)):
            _, tokens[name] = _time_generate(target, ids, args.new_tokens)  # warm-up
        for _ in range(args.repeats):
            for name, target in (("plain", plain), ("fast", engine)):
                times[name].append(_time_generate(target, ids, args.new_tokens)[0])
        plain_s, fast_s = statistics.median(times["plain"]), statistics.median(times["fast"])
        same = tokens["plain"] == tokens["fast"]
        each = " / ".join(f"{p * 1e3:.0f}:{f * 1e3:.0f}" for p, f in zip(times["plain"], times["fast"]))
        rows.append(
            f"| {batch} | {plain_s * 1e3:.0f} | {fast_s * 1e3:.0f} | {plain_s / fast_s:.2f}x | "
            f"{batch * args.new_tokens / fast_s:.0f} | {'yes' if same else 'NO'} | {each} |"
        )
        mlp = next(layer[4] for layer in engine._decoder.layers if isinstance(layer[4], MoEMLP))
        sorted_s = _time_mlp(mlp, batch, cfg["hidden"], sync_free=False)
        every_s = _time_mlp(mlp, batch, cfg["hidden"], sync_free=True)
        mlp.sync_free = False
        floor_s = _time_expert_matmuls(mlp, batch, cfg["hidden"])
        mlp_rows.append(f"| {batch} | {sorted_s * 1e6:.0f} | {every_s * 1e6:.0f} | {floor_s * 1e6:.0f} |")
        print(rows[-1], mlp_rows[-1], flush=True)
    text = "\n".join(
        [
            f"# {date.today()}: fast MoE decoding on CPU (bench/bench_moe_inference.py)",
            "",
            f"Machine: {cpu_model()}, {args.threads} torch thread(s); torch {torch.__version__}.",
            f"Model: Mixtral from a config, {cfg}, fp32, "
            f"{sum(p.numel() for p in plain.parameters()) / 1e6:.1f}M parameters.",
            f"Prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy; median of "
            f"{args.repeats} alternating runs per side after one warm-up each.",
            "",
            "| batch | plain generate (ms) | fast path (ms) | speed-up | fast tokens/s | same tokens "
            "| runs plain:fast |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            "One MoE MLP on one decode step's tokens (us, mean of 200 calls):",
            "",
            "| tokens | sorted by expert (1 token: its experts in turn) | every expert on every token "
            "| expert matmuls alone |",
            "|---|---|---|---|",
            *mlp_rows,
            "",
            "Command: `python bench/bench_moe_inference.py " + " ".join(sys.argv[1:]) + "`",
            "",
        ]
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
