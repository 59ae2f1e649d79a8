"""The largest model that trains under a memory cap: plain PyTorch against shardwise with
the optimizer state and parameters on nvme.

The CPU stand-in for the issue's "largest model on one GPU" check: each trial runs in a
cgroup (v1 memory controller, so this needs root) whose limit plays the accelerator's
memory, builds a GPT of ``--width`` with some number of layers, and trains two steps; the
search finds the deepest model that finishes. Plain PyTorch keeps fp32 parameters,
gradients and fused-AdamW moments (16 bytes per parameter); shardwise runs ZeRO stage 3
on one rank with ``offload_optimizer`` and ``offload_param`` on nvme and the model built
under ``zero.Init(remote_device="nvme")``, so what stays in memory is the fp32 gradient
shard (4 bytes per parameter), the modules being computed and the activations. On a GPU
the gradient shard lives in host memory, not device memory, which is why the GPU ratio
can be larger than the one measured here.

    sudo python bench/bench_capacity.py --cap-gib 2 --swap /tmp/swap --out bench/results/x.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
CGROUP = Path("/sys/fs/cgroup/memory/shardwise-capacity")


def _gpt_config(args, layers: int):
    from gpt_model import GPTConfig
    return GPTConfig(vocab_size=args.vocab, width=args.width, num_layers=layers, num_heads=args.width // 64,
                     seq_len=args.seq_len, tie_weights=False)


def trial(args) -> None:
    """One training run (in the cgroup); prints a JSON line with the parameter count."""
    import torch
    from gpt_model import GPT

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    config = _gpt_config(args, args.layers)
    x = torch.randint(0, config.vocab_size, (1, config.seq_len))
    start = time.perf_counter()
    if args.variant == "torch":
        model = GPT(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        params = sum(p.numel() for p in model.parameters())
        for _ in range(2):
            model(x, x).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    else:
        import shardwise
        swap = {"device": "nvme", "nvme_path": args.swap}
        ds_config = {"train_micro_batch_size_per_gpu": 1,
                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                     "zero_optimization": {"stage": 3, "offload_optimizer": swap,
                                           "offload_param": {**swap, "max_in_cpu": 0},
                                           "sub_group_size": 10_000_000,
                                           "stage3_max_live_parameters": 2 * 12 * args.width ** 2}}
        with shardwise.zero.Init(remote_device="nvme", config_dict_or_path=ds_config):
            model = GPT(config)
        params = sum(p.ds_numel for p in model.parameters())
        engine, _, _, _ = shardwise.initialize(model=model, config=ds_config)
        for _ in range(2):
            engine.backward(engine(x, x))
            engine.step()
    print(json.dumps({"params": params, "seconds": time.perf_counter() - start}), flush=True)
    os._exit(0)


def _run_trial(args, variant: str, layers: int) -> dict | None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}", "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}
    if args.malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    cmd = [sys.executable, __file__, "--trial", "--variant", variant, "--layers", str(layers),
           "--width", str(args.width), "--vocab", str(args.vocab), "--seq-len", str(args.seq_len),
           "--swap", args.swap]
    # the child joins the cgroup before it starts Python (so its whole life is capped)
    wrapped = ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh", *cmd]
    proc = subprocess.run(wrapped, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return None
    return json.loads(lines[-1])


def search(args, variant: str, low: int, high: int) -> tuple[int, dict]:
    """Deepest model in [low, high] layers that trains (fits at ``low`` is checked first)."""
    results = {}
    for layers in (low, high):
        results[layers] = _run_trial(args, variant, layers)
        print(f"  {variant} {layers} layers: {results[layers]}", file=sys.stderr, flush=True)
    if results[low] is None:
        return 0, {}
    if results[high] is not None:
        return high, results[high]
    while high - low > 1:
        mid = (low + high) // 2
        results[mid] = _run_trial(args, variant, mid)
        print(f"  {variant} {mid} layers: {results[mid]}", file=sys.stderr, flush=True)
        low, high = (mid, high) if results[mid] is not None else (low, mid)
    return low, results[low]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap-gib", type=float, default=2.0, help="memory limit of each trial")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--swap", default="/tmp/swap", help="nvme_path for shardwise's swap files")
    parser.add_argument("--torch-layers", default="1,16", help="search range for plain PyTorch")
    parser.add_argument("--shardwise-layers", default="8,96", help="search range for shardwise")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None,
                        help="set MALLOC_MMAP_THRESHOLD_ (bytes) for every trial: glibc then returns "
                             "large freed blocks to the system at once")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=None)
    parser.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        return trial(args)
    Path(args.swap).mkdir(parents=True, exist_ok=True)
    if CGROUP.exists():  # left by an interrupted run
        CGROUP.rmdir()
    CGROUP.mkdir()
    (CGROUP / "memory.limit_in_bytes").write_text(str(int(args.cap_gib * 2 ** 30)))
    try:
        rows = []
        for variant, span in (("torch", args.torch_layers), ("shardwise", args.shardwise_layers)):
            low, high = (int(v) for v in span.split(","))
            layers, result = search(args, variant, low, high)
            rows.append((variant, layers, result))
    finally:
        CGROUP.rmdir()
    base = rows[0][2].get("params")
    lines = [f"# Largest GPT that trains two steps under a {args.cap_gib:g} GiB memory cap", "",
             f"{date.today()} | {os.cpu_count()} cores | width {args.width}, vocab {args.vocab}, seq "
             f"{args.seq_len}, micro-batch 1, AdamW | `bench/bench_capacity.py --cap-gib {args.cap_gib:g}`"
             + (f" with MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}" if args.malloc_mmap_threshold else ""),
             "",
             "| variant | layers | parameters (M) | seconds for 2 steps | parameters vs PyTorch |",
             "| --- | --- | --- | --- | --- |"]
    for variant, layers, result in rows:
        if not result:
            lines.append(f"| {variant} | none fits | | | |")
            continue
        ratio = f"{result['params'] / base:.1f}x" if base else "-"
        lines.append(f"| {variant} | {layers} | {result['params'] / 1e6:.0f} | {result['seconds']:.0f} | {ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
