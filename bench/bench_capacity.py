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

On a GPU (``--device cuda``) the GPU's own memory is the cap (``--cap-gib`` lowers it
with ``torch.cuda.set_per_process_memory_fraction``) and no cgroup is made. Plain PyTorch
trains under bf16 autocast with fp32 parameters and fused AdamW on the GPU; the shardwise
variants train in bf16 with the optimizer and parameters offloaded to CPU memory
(``offload-cpu``) or nvme (``offload-nvme``), the model built under ``zero.Init`` with the
matching ``remote_device``. Each trial also times its steps after the first and reports
TFLOP/s (6 x parameters x tokens plus the attention's 12 x layers x width x sequence x
tokens, per step). Host memory and the nvme path's free space bound the offloaded
variants there, not the GPU:

    python bench/bench_capacity.py --device cuda --width 4096 --seq-len 1024 --micro-batch 4 \
        --torch-layers 1,64 --shardwise-layers 8,256 --swap /local_nvme --out bench/results/x.md
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

    return GPTConfig(
        vocab_size=args.vocab,
        width=args.width,
        num_layers=layers,
        num_heads=args.width // 64,
        seq_len=args.seq_len,
        tie_weights=False,
    )


def trial(args) -> None:
    """One training run (in the cgroup on the CPU); prints a JSON line with the parameter
    count, the time of the whole trial and, after the first step, seconds and TFLOP/s per
    step."""
    import torch
    from gpt_model import GPT

    cuda = args.device == "cuda"
    if cuda and args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    config = _gpt_config(args, args.layers)
    device = torch.device(args.device)
    x = torch.randint(0, config.vocab_size, (args.micro_batch, config.seq_len), device=device)
    start = time.perf_counter()
    if args.variant == "torch":
        with device:
            model = GPT(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        params = sum(p.numel() for p in model.parameters())

        def train_step():
            with torch.autocast(args.device, dtype=torch.bfloat16, enabled=cuda):
                loss = model(x, x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    else:
        import shardwise

        tier = "cpu" if args.variant == "offload-cpu" else "nvme"
        where = {"device": tier, "nvme_path": args.swap}
        ds_config = {
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": where,
                "offload_param": {**where, "max_in_cpu": 0},
                "sub_group_size": 10_000_000,
                "stage3_max_live_parameters": 2 * 12 * args.width**2,
            },
        }
        if cuda:
            ds_config["bf16"] = {"enabled": True}
        with shardwise.zero.Init(remote_device=tier, config_dict_or_path=ds_config):
            model = GPT(config)
        params = sum(p.ds_numel for p in model.parameters())
        engine, _, _, _ = shardwise.initialize(model=model, config=ds_config)

        def train_step():
            engine.backward(engine(x, x))
            engine.step()

    step_s = []
    for _ in range(args.steps):
        begin = time.perf_counter()
        train_step()
        if cuda:
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - begin)
    timed = sorted(step_s[1:] or step_s)[len(step_s[1:] or step_s) // 2]  # median after the first
    tokens = args.micro_batch * config.seq_len
    flops = 6 * params * tokens + 12 * config.num_layers * config.width * config.seq_len * tokens
    result = {"params": params, "seconds": time.perf_counter() - start, "step_s": timed, "tflops": flops / timed / 1e12}
    if cuda:
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(result), flush=True)
    os._exit(0)


def _run_trial(args, variant: str, layers: int) -> dict | None:
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29533",
    }
    if args.malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    cmd = [
        sys.executable,
        __file__,
        "--trial",
        "--variant",
        variant,
        "--layers",
        str(layers),
        "--width",
        str(args.width),
        "--vocab",
        str(args.vocab),
        "--seq-len",
        str(args.seq_len),
        "--swap",
        args.swap,
        "--device",
        args.device,
        "--micro-batch",
        str(args.micro_batch),
        "--steps",
        str(args.steps),
        "--cap-gib",
        str(args.cap_gib),
    ]
    if args.device == "cpu":  # the child joins the cgroup before it starts Python (so its whole life is capped)
        cmd = ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh", *cmd]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return None
    return json.loads(lines[-1])


def search(args, variant: str, low: int, high: int) -> tuple[int, dict]:
    """Deepest model in [low, high] layers that trains (fits at ``low`` is checked first)."""
    results = {}
    for layers in sorted({low, high}):  # one trial when low == high
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
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: a cgroup plays the accelerator's memory; cuda: the GPU's own memory",
    )
    parser.add_argument(
        "--cap-gib",
        type=float,
        default=None,
        help="memory limit of each trial (cpu: default 2; cuda: default the whole GPU)",
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated: torch, offload-cpu, offload-nvme (default: torch,offload-nvme "
        "on cpu; torch,offload-cpu,offload-nvme on cuda)",
    )
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="training steps per trial (timed after the first)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--swap", default="/tmp/swap", help="nvme_path for shardwise's swap files")
    parser.add_argument("--torch-layers", default="1,16", help="search range for plain PyTorch")
    parser.add_argument("--shardwise-layers", default="8,96", help="search range for shardwise")
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        help="set MALLOC_MMAP_THRESHOLD_ (bytes) for every trial: glibc then returns "
        "large freed blocks to the system at once",
    )
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=None)
    parser.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        return trial(args)
    cpu = args.device == "cpu"
    if cpu and args.cap_gib is None:
        args.cap_gib = 2.0
    variants = (args.variants or ("torch,offload-nvme" if cpu else "torch,offload-cpu,offload-nvme")).split(",")
    Path(args.swap).mkdir(parents=True, exist_ok=True)
    if cpu:
        if CGROUP.exists():  # left by an interrupted run
            CGROUP.rmdir()
        CGROUP.mkdir()
        (CGROUP / "memory.limit_in_bytes").write_text(str(int(args.cap_gib * 2**30)))
    try:
        rows = []
        for variant in variants:
            span = args.torch_layers if variant == "torch" else args.shardwise_layers
            low, high = (int(v) for v in span.split(","))
            layers, result = search(args, variant, low, high)
            rows.append((variant, layers, result))
    finally:
        if cpu:
            CGROUP.rmdir()
    print(report(args, rows))
    if args.out:
        Path(args.out).write_text(report(args, rows))


def _device_name(args) -> str:
    if args.device == "cuda":
        import torch

        return f"{torch.cuda.get_device_name(0)} | torch {torch.__version__}"
    return f"{os.cpu_count()} cores"


def report(args, rows) -> str:
    """The markdown table of ``rows`` (variant, layers, trial result)."""
    base = rows[0][2].get("params") if rows and rows[0][0] == "torch" else None
    cap = f"a {args.cap_gib:g} GiB memory cap" if args.cap_gib else "the GPU's memory"
    lines = [
        f"# Largest GPT that trains {args.steps} steps under {cap}",
        "",
        f"{date.today()} | {_device_name(args)} | width {args.width}, vocab {args.vocab}, seq "
        f"{args.seq_len}, micro-batch {args.micro_batch}, AdamW | `bench/bench_capacity.py --device "
        f"{args.device}"
        + (f" --cap-gib {args.cap_gib:g}" if args.cap_gib else "")
        + "`"
        + (f" with MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}" if args.malloc_mmap_threshold else ""),
        "",
        "| variant | layers | parameters (M) | seconds for the trial | s/step | TFLOP/s | peak GPU GiB "
        "| parameters vs PyTorch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant, layers, result in rows:
        if not result:
            lines.append(f"| {variant} | none fits | | | | | | |")
            continue
        ratio = f"{result['params'] / base:.1f}x" if base else "-"
        peak = f"{result['peak_gpu_gib']:.1f}" if "peak_gpu_gib" in result else "-"
        lines.append(
            f"| {variant} | {layers} | {result['params'] / 1e6:.0f} | {result['seconds']:.0f} | "
            f"{result['step_s']:.3f} | {result['tflops']:.3f} | {peak} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
