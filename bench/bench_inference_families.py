"""Greedy decoding on CPU, every family the fast path serves: shardwise's
``init_inference(replace_with_kernel_inject=True)`` against plain Hugging Face ``generate``
on the same model, batch 1 and 8, two model sizes (issue 37).

Each (family, size) runs in one process: the model is built from ``torch.manual_seed(0)``
(no downloads), deep-copied, and one copy goes to ``init_inference`` (the fast path
re-stores weights, so the baseline keeps its own). Then, per batch size, one warm-up
generation of each, and ``--rounds`` rounds that time the fast path and ``generate``
alternately (the order flips every round). Each round's ratio is fast / generate; the
table shows medians over rounds, the ratios' spread, and whether the fast path's greedy
tokens equal ``generate``'s in every round::

    python bench/bench_inference_families.py --out bench/results/<date>-cpu-inference-families.md
    python bench/bench_inference_families.py --families llama gpt2 --sizes small --rounds 3

``--jobs`` runs several (family, size) processes at once: on a machine shared by many
processes it shortens the run without changing what a ratio compares (each process
alternates its own two sides).

Random-token prompts of ``--prompt`` tokens, ``--new-tokens`` new tokens forced (no
end-of-sequence stop), fp32, ``torch.set_num_threads(--threads)``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from _machine import cpu_model

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ["llama", "mistral", "qwen2", "gpt2", "opt", "gpt_neox"]
SIZES = {
    "small": dict(vocab=8000, hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704),
    "medium": dict(vocab=8000, hidden=768, layers=6, heads=12, kv_heads=4, intermediate=2048),
}


def build_model(family: str, size: dict, max_positions: int):
    """A randomly initialised model of ``family`` at ``size`` (fp32, sdpa attention, never
    stopping early)."""
    import torch
    import transformers

    torch.manual_seed(0)
    h, n, heads = size["hidden"], size["layers"], size["heads"]
    common = dict(vocab_size=size["vocab"], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family in ("llama", "mistral", "qwen2"):
        cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}.get(
            family, transformers.Qwen2Config
        )
        config = cls(
            hidden_size=h,
            intermediate_size=size["intermediate"],
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=size["kv_heads"],
            max_position_embeddings=max_positions,
            tie_word_embeddings=False,
            **common,
        )
    elif family == "gpt2":
        config = transformers.GPT2Config(n_embd=h, n_layer=n, n_head=heads, n_positions=max_positions, **common)
    elif family == "opt":
        config = transformers.OPTConfig(
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=heads,
            ffn_dim=4 * h,
            max_position_embeddings=max_positions,
            word_embed_proj_dim=h,
            **common,
        )
    elif family == "gpt_neox":
        config = transformers.GPTNeoXConfig(
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=heads,
            intermediate_size=4 * h,
            max_position_embeddings=max_positions,
            rotary_pct=0.25,
            **common,
        )
    else:
        raise ValueError(f"unknown family {family!r} (families: {FAMILIES})")
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.generation_config, key, None)
    return model.eval()


def _timed(fn) -> tuple[float, list]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out.tolist()


def worker(args) -> None:
    """One (family, size): alternating rounds per batch size; prints one JSON line."""
    import torch

    import shardwise

    torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    model = build_model(args.family, size, args.prompt + args.new_tokens + 8)
    baseline = copy.deepcopy(model)
    engine = shardwise.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    assert engine.fast_path, f"{args.family}: no fast path"
    result = {"params": sum(p.numel() for p in baseline.parameters()), "batches": {}}
    kw = dict(max_new_tokens=args.new_tokens, do_sample=False)
    for batch in args.batches:
        ids = torch.randint(0, size["vocab"], (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
        mask = torch.ones_like(ids)

        def fast(ids=ids, mask=mask):
            return engine.generate(ids, attention_mask=mask, **kw)

        def plain(ids=ids, mask=mask):
            with torch.inference_mode():
                return baseline.generate(ids, attention_mask=mask, **kw)

        fast(), plain()  # warm-up
        rounds = []
        for r in range(args.rounds):
            order = [("fast", fast), ("hf", plain)] if r % 2 == 0 else [("hf", plain), ("fast", fast)]
            times, tokens = {}, {}
            for name, fn in order:
                times[name], tokens[name] = _timed(fn)
            rounds.append({"fast_s": times["fast"], "hf_s": times["hf"], "equal": tokens["fast"] == tokens["hf"]})
        result["batches"][str(batch)] = rounds
    print("RESULT " + json.dumps(result), flush=True)


def _ms_per_token(seconds: float, args) -> float:
    return 1000 * seconds / args.new_tokens


def report(args, results: dict, wall: float, load: tuple[str, str]) -> str:
    lines = [
        "# Greedy decoding on CPU, every fast-path family: shardwise init_inference vs plain generate",
        "",
        f"{date.today()} | {cpu_model()} ({os.cpu_count()} cores) | torch threads {args.threads} | fp32 | "
        f"prompt {args.prompt}, {args.new_tokens} new tokens | {args.rounds} alternating rounds per row",
        "",
        f"Command: `python bench/bench_inference_families.py {' '.join(sys.argv[1:])}`",
        "",
        f"Load (`uptime`) before: {load[0]}; after: {load[1]}. Wall time {wall:.0f} s.",
        "",
    ]
    for name in args.sizes:
        s = SIZES[name]
        lines += [
            f"### {name}: hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads, vocab {s['vocab']}",
            "",
            "| family | params | batch | fast ms/token | generate ms/token | ratio (median) | ratio min-max "
            "| tokens equal | <= 0.7x |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for family in args.families:
            res = results.get((family, name))
            if res is None or "error" in res:
                lines.append(f"| {family} | | | error: {res and res.get('error')} | | | | | |")
                continue
            for batch, rounds in res["batches"].items():
                fast = statistics.median(r["fast_s"] for r in rounds)
                hf = statistics.median(r["hf_s"] for r in rounds)
                ratios = [r["fast_s"] / r["hf_s"] for r in rounds]
                ratio = statistics.median(ratios)
                equal = "all" if all(r["equal"] for r in rounds) else "NO"
                lines.append(
                    f"| {family} | {res['params'] / 1e6:.1f}M | {batch} | {_ms_per_token(fast, args):.2f} "
                    f"| {_ms_per_token(hf, args):.2f} | {ratio:.2f} | {min(ratios):.2f}-{max(ratios):.2f} "
                    f"| {equal} | {'met' if ratio <= 0.7 else 'NOT met'} |"
                )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--jobs", type=int, default=1, help="(family, size) processes at once (each alternates its own rounds)"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", nargs=2, metavar=("FAMILY", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.family, args.size = args.worker
        worker(args)
        return
    load_before = os.popen("uptime").read().strip()
    start = time.perf_counter()
    results = {}
    passthrough = [
        *("--batches", *map(str, args.batches)),
        *("--rounds", str(args.rounds), "--prompt", str(args.prompt)),
        *("--new-tokens", str(args.new_tokens), "--threads", str(args.threads)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    pending = [(family, name) for name in args.sizes for family in args.families]
    running = {}
    while pending or running:
        while pending and len(running) < args.jobs:
            family, name = pending.pop(0)
            cmd = [sys.executable, __file__, "--worker", family, name, *passthrough]
            running[(family, name)] = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
            )
        key = next(iter(running))
        out, err = running.pop(key).communicate()
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        results[key] = json.loads(line[7:]) if line else {"error": err.strip()[-300:]}
        print(*key, "done" if line else err[-2000:], flush=True)
    text = report(args, results, time.perf_counter() - start, (load_before, os.popen("uptime").read().strip()))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
