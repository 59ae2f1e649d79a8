"""Tensor-parallel step time and memory: shardwise AutoTP against DeepSpeed AutoTP, in one run;
and what activation checkpointing saves and costs on the same model.

A Llama-style model built from ``transformers.LlamaConfig`` (no downloads; every rank builds
it from the same torch seed, so all variants start from the same weights) trains on 2 ranks
(CPU, gloo, fp32, one thread per rank, AdamW, gradient clipping 1.0), every variant launched
with ``python -m torch.distributed.run --nproc_per_node 2``, rounds alternating the order::

    python bench/bench_tensor_parallel.py --rounds 3 --out bench/results/<date>-cpu-tensor-parallel.md

Variants (``--variants``):

- ``shardwise-tp2``: ``shardwise.initialize`` with ``"tensor_parallel": {"autotp_size": 2}``
  (its built-in Llama policy: q/k/v/gate/up column-parallel, o/down row-parallel).
- ``deepspeed-tp2``: ``deepspeed.initialize`` (own interpreter, ``--ds-python``) with
  ``{"autotp_size": 2, "preset_model": "llama"}``: the same layers split.
- ``deepspeed-tp2-hfplan``: DeepSpeed with ``{"autotp_size": 2}`` alone; 0.19.8 then follows
  the model's Hugging Face tp_plan, which also splits ``lm_head`` (column-parallel, logits
  all-gathered), so each rank does less work than under the policy above.
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel``, half the global batch per rank.
- ``shardwise-dp2``: shardwise ZeRO-0 data parallel, half the global batch per rank.
- a ``-z1`` suffix runs ZeRO stage 1 instead of 0 (with tp2 on 2 ranks the data-parallel group
  has one rank, so stage 1 has nothing to partition: it measures the machinery's overhead).

Tensor-parallel ranks all see the whole micro-batch (``--micro-batch`` rows); data-parallel
ranks see their half of the same rows. Every variant gets the client
``torch.optim.AdamW(fused=True)``, built on the full model before ``initialize`` (both
libraries point it at the shards).

``--profile`` adds a torch.profiler table of two steps (rank 0) per variant;
``--comm-stats`` counts and times the collectives each variant issues (torch.distributed's
functions wrapped before either library is imported). ``--ac`` also (``--ac-only``: only)
measures activation checkpointing in one process: none, Hugging Face's
``activation_checkpointing_enable()`` (non-reentrant and reentrant) and
``shardwise.checkpointing.checkpoint`` (DeepSpeed's API) on every decoder layer, reporting the
bytes autograd saves for backward (``saved_tensors_hooks``), the memory held after forward and
the peak during the step, against the forward+backward time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

from _machine import cpu_model, median_or_nan

REPO = Path(__file__).resolve().parents[1]
SPLIT = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
"""The layers tensor parallelism splits (both libraries' Llama policy)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _parse(variant: str) -> tuple[str, str, int]:
    """``shardwise-tp2-z1`` -> ("shardwise", "tp2", 1); ``deepspeed-tp2-hfplan`` -> (.., "tp2-hfplan", 0)."""
    stage = 0
    match = re.search(r"-z(\d)$", variant)
    if match:
        stage, variant = int(match.group(1)), variant[: match.start()]
    system, _, mode = variant.partition("-")
    if system == "ddp":
        return "ddp", "dp2", stage
    return system, mode, stage


# -- the model --------------------------------------------------------------------------------


def build_model(args):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        use_cache=False,
    )
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def batches(args):
    import torch

    generator = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), generator=generator) for _ in range(args.steps)
    ]


# -- collective counters (--comm-stats) ---------------------------------------------------------


class _TimedWork:
    """An async collective's work whose ``wait`` adds its blocked time to the op's stats."""

    def __init__(self, work, stats):
        self._work, self._stats = work, stats

    def wait(self, *a, **kw):
        start = time.perf_counter()
        try:
            return self._work.wait(*a, **kw)
        finally:
            self._stats["wait_s"] += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self._work, name)


def _wrap_collectives(stats: dict) -> None:
    """Count calls and bytes of torch.distributed's collectives, and the time they block the
    caller (a synchronous call's duration, or an async one's issue plus ``wait``)."""
    import torch
    import torch.distributed as dist

    def wrap(name, orig):
        def collective(*args, **kwargs):
            tensor = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
            entry = stats[name]
            entry["calls"] += 1
            entry["bytes"] += tensor.numel() * tensor.element_size() if tensor is not None else 0
            start = time.perf_counter()
            work = orig(*args, **kwargs)
            entry["issue_s"] += time.perf_counter() - start
            return _TimedWork(work, entry) if kwargs.get("async_op") and work is not None else work

        return collective

    for name in (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "broadcast",
        "all_reduce_coalesced",
    ):
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


# -- worker: one rank of one variant ------------------------------------------------------------


def _ds_config(args, system, mode, stage):
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch // (2 if mode == "dp2" else 1),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
    }
    if mode.startswith("tp2"):
        config["tensor_parallel"] = {"autotp_size": 2}
        if system == "deepspeed" and mode == "tp2":
            config["tensor_parallel"]["preset_model"] = "llama"
    if system == "deepspeed":
        config["zero_allow_untested_optimizer"] = True
    return config


def worker(args) -> None:
    stats = collections.defaultdict(lambda: collections.defaultdict(float))
    if args.comm_stats:
        _wrap_collectives(stats)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    system, mode, stage = _parse(args.variant)
    if system == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    model = build_model(args)
    full = {n: p.numel() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if system == "ddp":
        module = torch.nn.parallel.DistributedDataParallel(model)
        engine = None

        def forward(ids):
            return module(input_ids=ids, labels=ids).loss

        def backward(loss):
            loss.backward()

        def step():
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        params = module.module
    else:
        library = __import__(system)
        engine, optimizer, _, _ = library.initialize(
            model=model, optimizer=optimizer, config=_ds_config(args, system, mode, stage)
        )

        def forward(ids):
            return engine(input_ids=ids, labels=ids).loss

        def backward(loss):
            engine.backward(loss)

        def step():
            engine.step()

        params = engine.module
    named = dict(params.named_parameters())
    split_local = sum(p.numel() for n, p in named.items() if SPLIT.search(n))
    split_full = sum(v for n, v in full.items() if SPLIT.search(n))
    info = {
        "params": sum(p.numel() for p in named.values()),
        "param_bytes": sum(p.numel() * p.element_size() for p in named.values()),
        "split_params": split_local,
        "split_full": split_full,
        "full_params": sum(full.values()),
        "split_bytes": sum(p.numel() * p.element_size() for n, p in named.items() if SPLIT.search(n)),
        "lm_head": list(named["lm_head.weight"].shape) if "lm_head.weight" in named else None,
        "q_proj": list(next(p for n, p in named.items() if n.endswith("q_proj.weight")).shape),
    }
    print(
        f"[{args.variant}] rank {rank}: {info['params']:,} parameters ({info['param_bytes'] / 2**20:.1f} MiB), "
        f"split layers {split_local:,} of {split_full:,}; q_proj {info['q_proj']}, lm_head {info['lm_head']}",
        flush=True,
    )
    rows = batches(args)
    if mode == "dp2":
        half = args.micro_batch // 2
        rows = [ids[rank * half : (rank + 1) * half] for ids in rows]
    times, phases, losses, profile, prof = [], [], [], None, None
    for i, ids in enumerate(rows):
        if i == args.warmup:
            for entry in stats.values():
                entry.clear()
            if args.profile:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
        start = time.perf_counter()
        loss = forward(ids)
        forward_end = time.perf_counter()
        backward(loss)
        backward_end = time.perf_counter()
        step()
        end = time.perf_counter()
        times.append(end - start)
        phases.append((forward_end - start, backward_end - forward_end, end - backward_end))
        losses.append(loss.item())
        if prof is not None and i == args.warmup + 1:
            prof.__exit__(None, None, None)
            profile = prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=args.profile_rows, max_name_column_width=60
            )
    timed = len(rows) - args.warmup
    result = {
        "times": times,
        "phases": phases,
        "losses": losses,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "info": info,
        "profile": profile,
        "comm": {k: {kk: vv / max(timed, 1) for kk, vv in v.items()} for k, v in stats.items()},
    }
    Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads sometimes abort it after a clean run


# -- driver -------------------------------------------------------------------------------------


def _model_args(args) -> list[str]:
    return [
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--intermediate",
        str(args.intermediate),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--seq-len",
        str(args.seq_len),
        "--micro-batch",
        str(args.micro_batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]


def run_variant(args, variant: str) -> dict:
    system, _, _ = _parse(variant)
    python = args.ds_python if system == "deepspeed" else sys.executable
    if not Path(python).exists():
        return {"error": f"interpreter {python} not found (see bench/README.md)"}
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result"
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "DS_ACCELERATOR": "cpu",
                "SHARDWISE_ACCELERATOR": "cpu",
                "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
                "TOKENIZERS_PARALLELISM": "false",
            }
            cmd = (
                [
                    python,
                    "-m",
                    "torch.distributed.run",
                    "--nproc_per_node",
                    "2",
                    "--master_addr",
                    "127.0.0.1",
                    "--master_port",
                    str(_free_port()),
                    __file__,
                    "--worker",
                    "--variant",
                    variant,
                    "--result",
                    str(result),
                ]
                + _model_args(args)
                + (["--profile", "--profile-rows", str(args.profile_rows)] if args.profile else [])
                + (["--comm-stats"] if args.comm_stats else [])
            )
            started = time.perf_counter()
            proc = subprocess.run(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout
            )
            wall = time.perf_counter() - started
            if proc.returncode == 0:
                ranks = [json.loads(result.with_suffix(f".rank{r}.json").read_text()) for r in range(2)]
                break
            if "EADDRINUSE" in proc.stdout and attempt < 2:
                continue
            lines = [ln for ln in proc.stdout.strip().splitlines() if "Error" in ln or "error" in ln]
            return {"error": (lines[-1] if lines else proc.stdout.strip().splitlines()[-1])[:200]}
    times = ranks[0]["times"][args.warmup :]
    if args.profile:
        times = times[2:]  # the two profiled steps
    return {
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
        "times": times,
        "rss_mb": [r["rss_mb"] for r in ranks],
        "info": [r["info"] for r in ranks],
        "wall_s": wall,
        "phases": [statistics.median(p[k] for p in ranks[0]["phases"][-len(times) :]) for k in range(3)],
        # data-parallel ranks see half the rows each: the global loss is their mean
        "losses": [statistics.fmean(v) for v in zip(*(r["losses"] for r in ranks))],
        "profile": ranks[0]["profile"],
        "comm": ranks[0]["comm"],
    }


def _versions(ds_python: str) -> str:
    import torch

    parts = [f"torch {torch.__version__}"]
    if Path(ds_python).exists():
        out = subprocess.run(
            [ds_python, "-c", "import deepspeed, transformers; print(deepspeed.__version__, transformers.__version__)"],
            capture_output=True,
            text=True,
            env={**os.environ, "DS_ACCELERATOR": "cpu"},
        )
        ds, tf = out.stdout.strip().splitlines()[-1].split() if out.returncode == 0 else ("unavailable", "?")
        parts.append(f"deepspeed {ds} (transformers {tf} in its env)")
    try:
        import transformers

        parts.append(f"transformers {transformers.__version__}")
    except ImportError:
        pass
    return ", ".join(parts)


def tp_report(args, runs: dict[str, list[dict]], order: list[list[str]]) -> str:
    ok = {v: [r for r in rs if "median" in r] for v, rs in runs.items()}
    med = {v: median_or_nan([r["median"] for r in rs]) for v, rs in ok.items()}
    base = "deepspeed-tp2"
    lines = [
        f"## Step time and memory, tp2 on 2 ranks (round order: {'; '.join(' '.join(o) for o in order)})",
        "",
        "| variant | runs | median s/step | run medians min-max | all steps min-max | vs deepspeed-tp2 | vs ddp "
        "| split layers MiB/rank (of full) | params MiB/rank | peak RSS MiB/rank |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant, rs in runs.items():
        good = ok[variant]
        if not good:
            lines.append(f"| {variant} | error: {rs[0].get('error')} | | | | | | | | |")
            continue
        info = good[0]["info"][0]

        def rel(other, variant=variant, med=med):
            return f"{med[variant] / med[other]:.3f}" if med.get(other) == med.get(other) and other in med else "-"

        rss = median_or_nan([max(r["rss_mb"]) for r in good])
        lines.append(
            f"| {variant} | {len(good)} | {med[variant]:.3f} | {min(r['median'] for r in good):.3f}-"
            f"{max(r['median'] for r in good):.3f} "
            f"| {min(r['min'] for r in good):.3f}-{max(r['max'] for r in good):.3f} "
            f"| {rel(base)} | {rel('ddp')} "
            f"| {info['split_bytes'] / 2**20:.1f} ({info['split_params'] / info['split_full']:.3f}) "
            f"| {info['param_bytes'] / 2**20:.1f} | {rss:.0f} |"
        )
    # paired ratios: shardwise / DeepSpeed within each round
    lines += ["", "Paired ratios (same round, so the same machine load):", ""]
    for a, b in (
        ("shardwise-tp2", "deepspeed-tp2"),
        ("shardwise-tp2", "deepspeed-tp2-hfplan"),
        ("shardwise-tp2-z1", "deepspeed-tp2-z1"),
        ("shardwise-tp2", "ddp"),
        ("deepspeed-tp2", "ddp"),
    ):
        if ok.get(a) and ok.get(b):
            pairs = [x["median"] / y["median"] for x, y in zip(runs[a], runs[b]) if "median" in x and "median" in y]
            if pairs:
                lines.append(
                    f"- {a} / {b}: median {statistics.median(pairs):.3f} "
                    f"(rounds: {', '.join(f'{p:.3f}' for p in pairs)})"
                )
    lines += [
        "",
        "Median seconds per phase (rank 0; forward, backward incl. the tensor-parallel all-reduces, "
        "optimizer step incl. clipping), median over runs; wall seconds per run incl. start-up:",
        "",
        "| variant | forward | backward | step | run wall s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for variant, rs in ok.items():
        if rs:
            f, b, st = (median_or_nan([r["phases"][k] for r in rs]) for k in range(3))
            lines.append(
                f"| {variant} | {f:.3f} | {b:.3f} | {st:.3f} | {median_or_nan([r['wall_s'] for r in rs]):.0f} |"
            )
    lines += ["", "Per-rank parameters (first run of each variant):", "", "```"]
    for variant, rs in ok.items():
        for rank, i in enumerate(rs[0]["info"] if rs else []):
            lines.append(
                f"{variant} rank {rank}: {i['params']:,} parameters ({i['param_bytes'] / 2**20:.1f} MiB), "
                f"split layers {i['split_params']:,} of {i['split_full']:,}; q_proj {i['q_proj']}, "
                f"lm_head {i['lm_head']}"
            )
    lines += [
        "```",
        "",
        f"Loss of the first {args.loss_steps} steps (first run; data-parallel: mean of the ranks' half-batch losses):",
        "",
        "| variant | " + " | ".join(f"step {i + 1}" for i in range(args.loss_steps)) + " |",
        "| --- |" + " --- |" * args.loss_steps,
    ]
    for variant, rs in ok.items():
        if rs:
            lines.append(f"| {variant} | " + " | ".join(f"{x:.6f}" for x in rs[0]["losses"][: args.loss_steps]) + " |")
    for a, b in (
        ("shardwise-tp2", "deepspeed-tp2"),
        ("shardwise-tp2", "deepspeed-tp2-hfplan"),
        ("shardwise-tp2", "ddp"),
        ("shardwise-tp2-z1", "deepspeed-tp2-z1"),
    ):
        if ok.get(a) and ok.get(b):
            diff = max(abs(x - y) for x, y in zip(ok[a][0]["losses"], ok[b][0]["losses"]))
            lines.append(f"\nmax |loss {a} - loss {b}| over all {args.steps} steps: {diff:.2e}")
    if args.comm_stats:
        lines += [
            "",
            "Collectives per step (rank 0, averaged over the timed steps): calls, MiB, ms blocked "
            "(synchronous call or async issue + wait):",
            "",
            "| variant | op | calls | MiB | ms blocked |",
            "| --- | --- | --- | --- | --- |",
        ]
        for variant, rs in ok.items():
            if rs:
                for op, s in sorted(rs[0]["comm"].items()):
                    if not s.get("calls"):
                        continue
                    lines.append(
                        f"| {variant} | {op} | {s.get('calls', 0):.1f} | {s.get('bytes', 0) / 2**20:.1f} | "
                        f"{1000 * (s.get('issue_s', 0) + s.get('wait_s', 0)):.1f} |"
                    )
    if args.profile:
        for variant, rs in ok.items():
            if rs and rs[0].get("profile"):
                lines += [
                    "",
                    f"Profile of {variant} (rank 0, two steps, by self CPU time):",
                    "",
                    "```",
                    rs[0]["profile"].rstrip(),
                    "```",
                ]
    return "\n".join(lines) + "\n"


# -- activation checkpointing (one process) -----------------------------------------------------


def _anon_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ac_worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    model = build_model(args)
    model.train()
    mode = args.variant
    if mode == "hf":
        model.activation_checkpointing_enable()  # torch.utils.checkpoint, use_reentrant=False
    elif mode == "hf-reentrant":
        model.activation_checkpointing_enable({"use_reentrant": True})
    elif mode == "shardwise":
        import shardwise.checkpointing

        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=shardwise.checkpointing.checkpoint)
    elif mode == "deepspeed":
        import deepspeed

        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=deepspeed.checkpointing.checkpoint)
    elif mode != "none":
        raise ValueError(mode)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = batches(args)[0]

    def run_step(measure: bool):
        saved, seen = [0], set()

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in param_storages and ptr not in seen:
                seen.add(ptr)
                saved[0] += t.untyped_storage().nbytes()
            return t

        before = _anon_mb()
        peak, done = [before], threading.Event()

        def sample():
            while not done.wait(0.001):
                peak[0] = max(peak[0], _anon_mb())

        sampler = threading.Thread(target=sample, daemon=True)
        if measure:
            sampler.start()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        forward_s = time.perf_counter() - start
        held = _anon_mb() - before
        loss.backward()
        total_s = time.perf_counter() - start
        done.set()
        if measure:
            sampler.join()
        peak[0] = max(peak[0], _anon_mb())
        grads = [p.grad.clone() for p in model.parameters()][:3] if measure else None
        model.zero_grad(set_to_none=False)  # gradients stay allocated, as in a training loop
        return {
            "forward_s": forward_s,
            "step_s": total_s,
            "saved_mb": saved[0] / 2**20,
            "held_mb": held,
            "peak_mb": peak[0] - before,
            "loss": loss.item(),
            "grad_sum": sum(float(g.double().sum()) for g in grads) if grads else None,
        }

    run_step(False)  # warm-up; allocates the gradients
    results = [run_step(args.ac_memory) for _ in range(args.ac_steps)]
    Path(args.result).write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)


def run_ac(args, variant: str, memory: bool) -> dict:
    python = args.ds_python if variant == "deepspeed" else sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "ac.json"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "SHARDWISE_ACCELERATOR": "cpu",
            "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
        }
        if memory:  # every block of 64 KiB or more is its own mapping, returned on free: RSS follows the tensors
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        cmd = (
            [
                python,
                __file__,
                "--ac-worker",
                "--variant",
                variant,
                "--result",
                str(result),
                "--ac-steps",
                str(2 if memory else args.ac_steps),
            ]
            + _model_args(args)
            + (["--ac-memory"] if memory else [])
        )
        proc = subprocess.run(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout
        )
        if proc.returncode != 0:
            lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
            return {"error": lines[-1][:200] if lines else "failed"}
        return {"steps": json.loads(result.read_text())}


def ac_report(args, timing: dict[str, list[dict]], memory: dict[str, dict]) -> str:
    lines = [
        f"## Activation checkpointing, one process, micro-batch {args.micro_batch} x {args.seq_len} tokens, "
        "every decoder layer checkpointed",
        "",
        "| variant | forward s | forward+backward s | vs none | saved for backward MiB (hooks) | "
        "held after forward MiB (RSS) | peak during step MiB (RSS) | loss | grad checksum |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = None
    for variant, rounds in timing.items():
        steps = [s for r in rounds if "steps" in r for s in r["steps"]]
        mem = memory.get(variant, {})
        if not steps or "steps" not in mem:
            err = next((r["error"] for r in rounds if "error" in r), mem.get("error", "?"))
            lines.append(f"| {variant} | error: {err} | | | | | | | |")
            continue
        fwd, tot = median_or_nan([s["forward_s"] for s in steps]), median_or_nan([s["step_s"] for s in steps])
        base = base or (tot if variant == "none" else None)
        m = mem["steps"]
        lines.append(
            f"| {variant} | {fwd:.3f} | {tot:.3f} | {tot / base:.2f} | "
            if base
            else f"| {variant} | {fwd:.3f} | {tot:.3f} | - | "
        )
        lines[-1] += (
            f"{median_or_nan([s['saved_mb'] for s in m]):.1f} | {median_or_nan([s['held_mb'] for s in m]):.1f} | "
            f"{median_or_nan([s['peak_mb'] for s in m]):.1f} | {m[0]['loss']:.6f} | {m[0]['grad_sum']:.6e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--variants", default="shardwise-tp2,deepspeed-tp2,ddp,shardwise-tp2-z1,deepspeed-tp2-z1,deepspeed-tp2-hfplan"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="each round runs every variant; odd rounds in reverse order"
    )
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=2,
        help="rows per step: every tensor-parallel rank sees all, each data-parallel rank half",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="leading steps left out of the median")
    parser.add_argument("--loss-steps", type=int, default=5)
    parser.add_argument("--ds-python", default=os.environ.get("DS_PYTHON", "/work/ds-env/bin/python"))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--profile", action="store_true", help="torch.profiler table of two steps per variant")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument("--comm-stats", action="store_true", help="count and time the collectives")
    parser.add_argument("--ac", action="store_true", help="also measure activation checkpointing")
    parser.add_argument("--ac-only", action="store_true", help="only measure activation checkpointing")
    parser.add_argument("--ac-variants", default="none,hf,hf-reentrant,shardwise,deepspeed")
    parser.add_argument("--ac-rounds", type=int, default=2)
    parser.add_argument("--ac-steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ac-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ac-memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.ac_worker:
        return ac_worker(args)
    started = time.perf_counter()
    header = [
        "# Tensor parallelism: shardwise AutoTP against DeepSpeed AutoTP",
        "",
        f"{date.today()} | {cpu_model()} ({os.cpu_count()} cores) | {_versions(args.ds_python)} | gloo, fp32",
        "",
        f"Llama (LlamaConfig, sdpa attention): vocab {args.vocab}, hidden {args.hidden}, intermediate "
        f"{args.intermediate}, {args.layers} layers, {args.heads} heads (no GQA), sequence {args.seq_len}, "
        f"{args.micro_batch} rows per step; AdamW (torch, fused) lr 1e-4, clipping 1.0; 2 ranks x 1 thread; "
        f"median of steps {args.warmup + 1}..{args.steps}",
        "",
    ]
    sections = []
    if not args.ac_only:
        variants = args.variants.split(",")
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        order = []
        for r in range(args.rounds):
            round_order = variants if r % 2 == 0 else variants[::-1]
            order.append(round_order)
            for variant in round_order:
                print(f"round {r + 1}: {variant} ...", file=sys.stderr, flush=True)
                out = run_variant(args, variant)
                runs[variant].append(out)
                summary = out.get("error") or (
                    f"{out['median']:.3f} s/step (run {out['wall_s']:.0f} s), losses {out['losses'][:3]}"
                )
                print(f"  {summary}", file=sys.stderr, flush=True)
        sections.append(tp_report(args, runs, order))
    if args.ac or args.ac_only:
        variants = args.ac_variants.split(",")
        timing: dict[str, list[dict]] = {v: [] for v in variants}
        for r in range(args.ac_rounds):
            for variant in variants if r % 2 == 0 else variants[::-1]:
                print(f"activation checkpointing round {r + 1}: {variant} ...", file=sys.stderr, flush=True)
                timing[variant].append(run_ac(args, variant, memory=False))
        memory = {}
        for variant in variants:
            print(f"activation checkpointing memory: {variant} ...", file=sys.stderr, flush=True)
            memory[variant] = run_ac(args, variant, memory=True)
        sections.append(ac_report(args, timing, memory))
    text = "\n".join(header + sections) + f"\nwall time of the benchmark: {time.perf_counter() - started:.0f} s\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
