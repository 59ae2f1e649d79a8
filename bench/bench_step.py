"""Step time and memory of shardwise against PyTorch DDP, FSDP2 and DeepSpeed, in one run.

Each variant trains the GPT of ``examples/gpt_model.py`` on 2 ranks (gloo, CPU, one
thread per rank) with AdamW and gradient clipping, one variant after another; the table
reports medians, spreads and ratios to the first DDP run (see ../shared/BENCHMARKS.md).

    python bench/bench_step.py --variants floor,ddp,shardwise0,ddp,deepspeed0 --out bench/results/x.md

Variants: ``floor`` (each rank trains alone: the compute-only floor), ``ddp``, ``fsdp2``,
``shardwise<stage>``, ``shardwise<stage>m`` (the same with TensorBoard and CSV monitors, the
wall-clock and memory breakdowns, the comms logger, and the FLOPs profiler on the second
step, inside the warm-up the median leaves out: their overhead, and the profiler's achieved
TFLOP/s), ``deepspeed<stage>``. DeepSpeed runs in its own interpreter (``--ds-python``) so
it is never a dependency of shardwise.

``--checkpoint DIR`` also saves a checkpoint after the steps and loads it back, each
variant its own way (DDP: ``torch.save``/``torch.load`` of the state dicts on rank 0; FSDP2:
``torch.distributed.checkpoint``; shardwise and DeepSpeed: their engine's
``save_checkpoint``/``load_checkpoint``), and reports the time of each and the peak
memory above what the rank held before it: anonymous memory (sampled every 2 ms) and
the resident high-water mark (``VmHWM``, reset before each; it includes file pages a
mapped load touches).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from _machine import cpu_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- worker: one rank of one variant --------------------------------------------------------


def _config(args, stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage, **json.loads(args.zero)},
        "zero_allow_untested_optimizer": True,
    }


def _state_bytes(model, optimizer) -> int:
    tensors = list(model.parameters())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # FSDP2 DTensors
    return sum(t.numel() * t.element_size() for t in local)


def _build(args, variant: str, model):
    """Returns (step_fn, state_bytes_fn, save_fn(dir), load_fn(dir)) for one variant."""
    import torch

    kernel = {"fused": True} if args.peer_kernel == "fused" else {"foreach": True}
    adamw = lambda params: torch.optim.AdamW(params, lr=3e-4, **kernel)  # noqa: E731
    if variant in ("floor", "ddp", "fsdp2"):
        if variant == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        if variant == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        optimizer = adamw(model.parameters())

        def step(x, y):
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        save, load = (_dcp_save_load if variant == "fsdp2" else _torch_save_load)(model, optimizer)
        return step, lambda: _state_bytes(model, optimizer), save, load
    monitored = variant.endswith("m")
    stage = int(variant.rstrip("m")[-1])
    if variant.startswith("shardwise"):
        import shardwise

        config = {**_config(args, stage), "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}
        del config["zero_allow_untested_optimizer"]
        if monitored:
            config.update(_monitoring(Path(args.result).parent))
        engine, _, _, _ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
        return (
            _engine_step(engine),
            lambda: engine.model_state_bytes().total,
            engine.save_checkpoint,
            engine.load_checkpoint,
        )
    import deepspeed

    if args.ds_optimizer == "config":  # DeepSpeed builds its own (DeepSpeedCPUAdam under offload)
        config = {**_config(args, stage), "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=adamw(model.parameters()), config=_config(args, stage)
        )
    # DeepSpeed's buffers are not all visible
    return _engine_step(engine), lambda: float("nan"), engine.save_checkpoint, engine.load_checkpoint


def _monitoring(folder: Path) -> dict:
    """The ``shardwise<stage>m`` variants' config: every monitor that writes locally, the
    wall-clock and memory breakdowns, the comms logger, and the FLOPs profiler on the second
    step (global_steps 1, inside the warm-up)."""
    files = {"enabled": True, "output_path": str(folder), "job_name": "bench"}
    return {
        "tensorboard": files,
        "csv_monitor": files,
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "comms_logger": {"enabled": True},
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": str(folder / "flops.txt")},
    }


def _achieved_tflops(folder: Path) -> float | None:
    """The profiler's "achieved TFLOP/s per GPU" line of a monitored run (rank 0's file)."""
    path = folder / "flops.txt"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.startswith("achieved TFLOP/s per GPU"):
            return float(line.split(":")[1])
    return None


def _torch_save_load(model, optimizer):
    """Plain PyTorch checkpointing: rank 0 saves the state dicts, every rank loads them."""
    import torch
    import torch.distributed as dist

    def save(folder):
        if not dist.is_initialized() or dist.get_rank() == 0:
            Path(folder).mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, Path(folder) / "state.pt")
        if dist.is_initialized():
            dist.barrier()

    def load(folder):
        state = torch.load(Path(folder) / "state.pt", map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    return save, load


def _dcp_save_load(model, optimizer):
    """FSDP2's checkpointing: torch.distributed.checkpoint, each rank writing its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def save(folder):
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder))

    def load(folder):
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    return save, load


def _memory_mb() -> tuple[float, float]:
    """(anonymous resident MB, resident high-water mark MB) of this process."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["RssAnon"], fields["VmHWM"]


def _measure(fn) -> dict:
    """Run ``fn``; its time, and its peak memory above the memory held before it."""
    import threading

    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    anon_before, hwm_before = _memory_mb()
    peak = [anon_before]
    done = threading.Event()

    def sample():
        while not done.wait(0.002):
            peak[0] = max(peak[0], _memory_mb()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    anon_after, hwm_after = _memory_mb()
    return {"s": seconds, "anon_mb": max(peak[0], anon_after) - anon_before, "hwm_mb": hwm_after - hwm_before}


def _engine_step(engine):
    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    return step


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from gpt_model import GPT, GPT_PRESETS

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if args.variant.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    elif args.variant != "floor":
        dist.init_process_group("gloo")
    config = GPT_PRESETS[args.preset]
    torch.manual_seed(0)
    if args.zero_init and args.variant in ("shardwise3", "deepspeed3"):
        # built partitioned, as a model too large for one rank would be
        library = __import__("shardwise" if args.variant == "shardwise3" else "deepspeed")
        with library.zero.Init(config_dict_or_path=_config(args, 3)):
            model = GPT(config)
    else:
        model = GPT(config)
    step, state_bytes, save, load = _build(args, args.variant, model)
    generator = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, config.vocab_size, (args.micro_batch, config.seq_len), generator=generator)
    y = torch.randint(0, config.vocab_size, (args.micro_batch, config.seq_len), generator=generator)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    result = {
        "times": times,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "state_mb": state_bytes() / 2**20,
    }
    if args.variant.endswith("m") and rank == 0:
        result["achieved_tflops"] = _achieved_tflops(Path(args.result).parent)
    if args.checkpoint:
        import shutil

        folder = Path(args.checkpoint) / args.variant
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()
        result["save"] = _measure(lambda: save(folder))
        if dist.is_initialized():
            dist.barrier()
        result["load"] = _measure(lambda: load(folder))
        result["checkpoint_mb"] = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
        if dist.is_initialized():
            dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads sometimes abort it after a clean run


# -- driver -----------------------------------------------------------------------------------


def run_variant(args, variant: str) -> dict:
    python = args.ds_python if variant.startswith("deepspeed") else sys.executable
    if variant.startswith("deepspeed") and not Path(python).exists():
        return {"error": f"DeepSpeed interpreter {python} not found (see bench/README.md)"}
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result"
        procs = []
        for rank in range(args.world_size):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(args.world_size),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "DS_ACCELERATOR": "cpu",
                "SHARDWISE_ACCELERATOR": "cpu",
                "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
            }
            if variant == "floor":
                env["WORLD_SIZE"] = "1"
            cmd = (
                [
                    python,
                    __file__,
                    "--worker",
                    "--variant",
                    variant,
                    "--preset",
                    args.preset,
                    "--steps",
                    str(args.steps),
                    "--micro-batch",
                    str(args.micro_batch),
                    "--result",
                    str(result),
                    "--zero",
                    args.zero,
                    "--peer-kernel",
                    args.peer_kernel,
                    "--ds-optimizer",
                    args.ds_optimizer,
                ]
                + (["--zero-init"] if args.zero_init else [])
                + (["--checkpoint", args.checkpoint] if args.checkpoint else [])
            )
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        if any(p.returncode for p in procs):
            failed = next(o for p, o in zip(procs, outputs) if p.returncode)
            lines = [ln for ln in failed.strip().splitlines() if ln.strip()]
            return {"error": lines[-1][:160] if lines else "failed"}
        ranks = [json.loads(result.with_suffix(f".rank{r}.json").read_text()) for r in range(args.world_size)]
    times = ranks[0]["times"][args.warmup :]
    out = {
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
        "rss_mb": max(r["rss_mb"] for r in ranks),
        "state_mb": max(r["state_mb"] for r in ranks),
    }
    if "achieved_tflops" in ranks[0]:
        out["achieved_tflops"] = ranks[0]["achieved_tflops"]
    if args.checkpoint:
        for op in ("save", "load"):  # the slowest rank's time, the largest rank's memory
            out[op] = {key: max(r[op][key] for r in ranks) for key in ("s", "anon_mb", "hwm_mb")}
        out["checkpoint_mb"] = ranks[0]["checkpoint_mb"]
    return out


def _versions(ds_python: str) -> str:
    import torch

    parts = [f"torch {torch.__version__}"]
    if Path(ds_python).exists():
        out = subprocess.run(
            [ds_python, "-c", "import deepspeed; print(deepspeed.__version__)"],
            capture_output=True,
            text=True,
            env={**os.environ, "DS_ACCELERATOR": "cpu"},
        )
        parts.append(f"deepspeed {out.stdout.strip().splitlines()[-1] if out.returncode == 0 else 'unavailable'}")
    return ", ".join(parts)


def table(args, results: list[tuple[str, dict]]) -> str:
    base = next((r["median"] for v, r in results if v == "ddp" and "median" in r), None)
    floor = next((r["median"] for v, r in results if v == "floor" and "median" in r), None)
    zero = f", zero_optimization += {args.zero}" if args.zero != "{}" else ""
    zero += f", peers' AdamW {args.peer_kernel}" + (", stage-3 models built under zero.Init" if args.zero_init else "")
    zero += ", DeepSpeed's optimizer from its config" if args.ds_optimizer == "config" else ""
    lines = [
        f"# Step time, preset `{args.preset}`, {args.world_size} ranks, micro-batch {args.micro_batch}{zero}",
        "",
        f"{date.today()} | {cpu_model()} ({os.cpu_count()} cores) | {_versions(args.ds_python)} | "
        f"median of steps {args.warmup + 1}..{args.steps}",
        "",
        "| variant | median s/step | min-max | vs DDP | vs floor | peak RSS MB/rank | model-state MB/rank |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant, r in results:
        if "error" in r:
            lines.append(f"| {variant} | error: {r['error']} | | | | | |")
            continue
        vs_ddp = f"{r['median'] / base:.2f}" if base else "-"
        vs_floor = f"{r['median'] / floor:.2f}" if floor else "-"
        lines.append(
            f"| {variant} | {r['median']:.3f} | {r['min']:.3f}-{r['max']:.3f} | {vs_ddp} | "
            f"{vs_floor} | {r['rss_mb']:.0f} | {r['state_mb']:.0f} |".replace("| nan |", "| - |")
        )
    monitored = [(v, r) for v, r in results if v.endswith("m") and "median" in r]
    if monitored:
        lines += [
            "",
            "Monitoring overhead (each `shardwise<stage>m` against the median of the plain "
            "`shardwise<stage>` runs; the FLOPs profiler's figure is rank 0's profiled step):",
            "",
            "| variant | median s/step | vs without monitoring | achieved TFLOP/s (profiler) |",
            "| --- | --- | --- | --- |",
        ]
        for variant, r in monitored:
            plain = [p["median"] for v, p in results if v == variant[:-1] and "median" in p]
            ratio = f"{r['median'] / statistics.median(plain):.3f}" if plain else "-"
            tflops = r.get("achieved_tflops")
            lines.append(f"| {variant} | {r['median']:.3f} | {ratio} | {tflops if tflops is not None else '-'} |")
    if args.checkpoint:
        lines += [
            "",
            "Checkpoint after the steps (per rank: slowest time, largest extra memory above what "
            "the rank held before; ratios to the first DDP run):",
            "",
            "| variant | save s | save peak anon MB | save VmHWM MB | load s | load peak anon MB | "
            "load VmHWM MB | checkpoint MB | save anon vs DDP | load anon vs DDP |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        ddp = next((r for v, r in results if v == "ddp" and "save" in r), None)
        for variant, r in results:
            if "save" not in r:
                continue

            def ratio(op, r=r):
                return f"{r[op]['anon_mb'] / ddp[op]['anon_mb']:.2f}" if ddp and ddp[op]["anon_mb"] > 0 else "-"

            lines.append(
                f"| {variant} | {r['save']['s']:.2f} | {r['save']['anon_mb']:.0f} | {r['save']['hwm_mb']:.0f} "
                f"| {r['load']['s']:.2f} | {r['load']['anon_mb']:.0f} | {r['load']['hwm_mb']:.0f} | "
                f"{r['checkpoint_mb']:.0f} | {ratio('save')} | {ratio('load')} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="floor,ddp,shardwise0,ddp,deepspeed0")
    parser.add_argument("--preset", default="reference", choices=["tiny", "reference", "memory"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="leading steps left out of the median")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--zero",
        default="{}",
        help="JSON merged into zero_optimization for shardwise and "
        "DeepSpeed, e.g. '{\"stage3_max_reuse_distance\": 0}'",
    )
    parser.add_argument(
        "--zero-init", action="store_true", help="build the shardwise3 and deepspeed3 models under their zero.Init"
    )
    parser.add_argument(
        "--peer-kernel",
        default="foreach",
        choices=["foreach", "fused"],
        help="torch AdamW kernel of the DDP, FSDP2 and DeepSpeed variants (shardwise "
        "picks its own: fused on CPU and CUDA)",
    )
    parser.add_argument(
        "--ds-optimizer",
        default="client",
        choices=["client", "config"],
        help="client: DeepSpeed steps the same torch AdamW as the peers; config: an "
        "'optimizer' section lets DeepSpeed pick its own (DeepSpeedCPUAdam with offload)",
    )
    parser.add_argument("--ds-python", default=os.environ.get("DS_PYTHON", "/work/ds-env/bin/python"))
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="after the steps, save a checkpoint under this folder and load it back, and report their time and memory",
    )
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    results = []
    for variant in args.variants.split(","):
        print(f"running {variant} ...", file=sys.stderr, flush=True)
        results.append((variant, run_variant(args, variant)))
        print(f"  {results[-1][1]}", file=sys.stderr, flush=True)
    text = table(args, results)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
