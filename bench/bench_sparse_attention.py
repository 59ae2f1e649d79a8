"""Block-sparse attention on CPU: ``SparseSelfAttention`` against dense
``torch.nn.functional.scaled_dot_product_attention``, forward+backward time and peak memory
per sequence length, and the longest sequence that trains within a memory budget (issue 18)::

    python bench/bench_sparse_attention.py --out bench/results/<date>-cpu-sparse-attention.md

Shape: batch 1, ``--heads`` heads (8), head_dim 64, fp32, one thread (``OMP_NUM_THREADS=1``,
``torch.set_num_threads(1)``), bidirectional everywhere (dense without ``is_causal``; every
layout built with ``attention="bidirectional"``), block 64. Random layouts (BigBird) are made
under ``torch.manual_seed(0)``.

Variants (``--layouts`` picks the sparse ones, ``--baselines`` the dense ones):

- ``dense``: SDPA as torch dispatches it; on CPU in fp32 that is its flash kernel
  (``_scaled_dot_product_flash_attention_for_cpu``), which never builds the scores.
- ``dense-math``: SDPA under ``sdpa_kernel(SDPBackend.MATH)``: the scores and probabilities are
  materialized (``seq^2 * heads`` floats each), the textbook dense attention.
- ``fixed``: ``FixedSparsityConfig`` (4 local blocks, 1 global block per window).
- ``variable``: ``VariableSparsityConfig`` (DeepSpeed's defaults: windows of 4, block 0 global).
- ``bigbird``: ``BigBirdSparsityConfig`` (1 random, 3 sliding, 1 global block).
- ``longformer``: ``BSLongformerSparsityConfig(num_sliding_window_blocks=3,
  global_block_indices=[0])``: the layout speed is judged on.
- ``sliding``: ``LocalSlidingWindowSparsityConfig(num_sliding_window_blocks=3)``.

Time: per length one fresh process runs every variant that fits the memory cap in
``--repeats`` rounds; a round runs ``dense`` first and last and the others in between, odd
rounds in reverse order. The first call of each variant (in which the sparse path builds its
plan) is reported apart from the median of the rounds; the module's construction (the
layout) is timed apart from both.

Memory: per (variant, length) a fresh process allocates q, k, v and the output gradient,
runs one forward+backward at 256 tokens (imports and one-time kernel setup), resets the
resident high-water mark (``/proc/self/clear_refs``), builds the module and runs
forward+backward twice; the peak is ``VmHWM`` minus the resident size before the module was
built, so it counts the layout, the plan, activations and the q/k/v gradients, not the inputs.
The process runs under ``RLIMIT_AS`` = its address space then + ``--mem-cap-gib``; a variant
that fails there is left out of the timing round and marked as skipped.

``--capacity``: per ``--capacity-variants`` the sequence length is doubled from 1024, each
attempt in a fresh process as above with the cap at ``--budget-gib``, until an attempt fails
(allocation refused, or the peak over the budget) or takes longer than ``--capacity-timeout``.
``--profile`` prints a torch.profiler table (time and memory per op) of one forward+backward
of ``--profile-variants`` (longformer, dense) at ``--profile-length`` (the longest length).
``--quick`` is a seconds-long smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINES = ("dense", "dense-math")
LAYOUTS = ("fixed", "variable", "bigbird", "longformer", "sliding")
BLOCK = 64
HEAD_DIM = 64


# ----------------------------------------------------------------------------- in the worker


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(field + r":\s+(\d+) kB", f.read()).group(1)) * 1024


def _sparsity_config(name: str, heads: int):
    from shardwise.ops import sparse_attention as sa

    bidi = {"attention": "bidirectional"}
    if name == "fixed":
        return sa.FixedSparsityConfig(heads, block=BLOCK, num_local_blocks=4, num_global_blocks=1, **bidi)
    if name == "variable":
        return sa.VariableSparsityConfig(heads, block=BLOCK, **bidi)
    if name == "bigbird":
        return sa.BigBirdSparsityConfig(
            heads, block=BLOCK, num_random_blocks=1, num_sliding_window_blocks=3, num_global_blocks=1, **bidi
        )
    if name == "longformer":
        return sa.BSLongformerSparsityConfig(
            heads, block=BLOCK, num_sliding_window_blocks=3, global_block_indices=[0], **bidi
        )
    if name == "sliding":
        return sa.LocalSlidingWindowSparsityConfig(heads, block=BLOCK, num_sliding_window_blocks=3, **bidi)
    raise ValueError(f"unknown variant {name!r}")


def _attention(name: str, heads: int, length: int):
    """(attention function, layout density); the module is built here (its layout made)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "dense":
        return F.scaled_dot_product_attention, 1.0
    if name == "dense-math":

        def math(q, k, v):
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v)

        return math, 1.0
    from shardwise.ops.sparse_attention import SparseSelfAttention

    torch.manual_seed(0)
    module = SparseSelfAttention(_sparsity_config(name, heads), max_seq_length=length)
    density = float(module.get_layout(length).float().mean())
    return module, density


def _inputs(heads: int, length: int):
    import torch

    torch.manual_seed(1)
    q, k, v = (torch.randn(1, heads, length, HEAD_DIM, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(1, heads, length, HEAD_DIM)


def _step(fn, q, k, v, grad) -> tuple[float, float]:
    """One forward+backward; (forward s, backward s). Gradients are dropped after."""
    start = time.perf_counter()
    out = fn(q, k, v)
    mid = time.perf_counter()
    out.backward(grad)
    end = time.perf_counter()
    del out
    q.grad = k.grad = v.grad = None
    return mid - start, end - mid


def _memory_worker(args) -> dict:
    """Peak memory of one variant at one length; see the module docstring."""
    import resource

    import torch

    # Warm up at a short length first, so that imports and the kernels' one-time setup are
    # not counted as the attention's memory.
    small = _inputs(args.heads, 4 * BLOCK)
    _step(_attention(args.variant, args.heads, 4 * BLOCK)[0], *small)
    del small
    q, k, v, grad = _inputs(args.heads, args.length)
    base = _status("VmRSS")
    limit = _status("VmSize") + int(args.cap_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    result = {"variant": args.variant, "length": args.length}
    try:
        start = time.perf_counter()
        fn, density = _attention(args.variant, args.heads, args.length)
        result.update(build_s=time.perf_counter() - start, density=density)
        result["first_s"] = sum(_step(fn, q, k, v, grad))
        result["peak_first"] = _status("VmHWM") - base
        result["second_s"] = sum(_step(fn, q, k, v, grad)) if args.calls > 1 else None
        result["peak"] = _status("VmHWM") - base
        result["ok"] = result["peak"] <= args.cap_gib * 2**30
        if not result["ok"]:
            result["error"] = "peak over the cap"
    except (RuntimeError, MemoryError) as error:
        refused = re.search(r"allocate (\d+) bytes", str(error))
        why = (
            f"{int(refused.group(1)) / 2**30:.2f} GiB allocation refused"
            if refused
            else f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
        )
        result.update(ok=False, peak=_status("VmHWM") - base, error=why)
    del torch
    return result


def _time_worker(args) -> dict:
    """Round-robin timing of several variants at one length; see the module docstring."""
    import shardwise.ops.sparse_attention  # noqa: F401 - not inside the first build's time

    q, k, v, grad = _inputs(args.heads, args.length)
    names = args.variant.split(",")
    inner = [n for n in names if n != "dense"]
    fns, out = {}, {n: {"fwd": [], "bwd": [], "dense_slot": []} for n in names}
    for name in names:
        start = time.perf_counter()
        fns[name], out[name]["density"] = _attention(name, args.heads, args.length)
        out[name]["build_s"] = time.perf_counter() - start
        fwd, bwd = _step(fns[name], q, k, v, grad)
        out[name]["first_s"] = fwd + bwd
    for rnd in range(args.repeats):
        order = inner if rnd % 2 == 0 else inner[::-1]
        order = (["dense"] + order + ["dense"]) if "dense" in names else order
        for slot, name in enumerate(order):
            fwd, bwd = _step(fns[name], q, k, v, grad)
            out[name]["fwd"].append(fwd)
            out[name]["bwd"].append(bwd)
            if name == "dense":
                out[name]["dense_slot"].append("first" if slot == 0 else "last")
    return out


def _profile_worker(args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    q, k, v, grad = _inputs(args.heads, args.length)
    tables = {}
    for name in args.variant.split(","):
        fn, _ = _attention(name, args.heads, args.length)
        _step(fn, q, k, v, grad)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _step(fn, q, k, v, grad)
        tables[name] = prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=args.profile_rows, max_name_column_width=50
        )
    del torch
    return tables


# ----------------------------------------------------------------------------- in the parent


def _run_worker(
    mode: str,
    variant: str,
    length: int,
    args,
    *,
    cap_gib: float | None = None,
    timeout: float | None = None,
    calls: int = 2,
) -> dict:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        mode,
        "--variant",
        variant,
        "--length",
        str(length),
        "--heads",
        str(args.heads),
        "--repeats",
        str(args.repeats),
        "--calls",
        str(calls),
        "--cap-gib",
        str(cap_gib if cap_gib is not None else args.mem_cap_gib),
        "--profile-rows",
        str(args.profile_rows),
    ]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {
            "ok": False,
            "error": f"over the {timeout:.0f} s time cap",
            "timeout": True,
            "wall_s": time.perf_counter() - start,
        }
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:160]
        return {"ok": False, "error": f"exit {proc.returncode}: {tail}", "wall_s": time.perf_counter() - start}
    result = json.loads(lines[-1][len("RESULT ") :])
    if mode != "profile":
        result["wall_s"] = time.perf_counter() - start
    return result


def _load(short: bool = False) -> str:
    loads = os.getloadavg()[:1] if short else os.getloadavg()
    return " ".join(f"{x:.2f}" for x in loads)


def _mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.0f}"


def _median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _measure(args, lengths, variants, log) -> tuple[dict, dict]:
    memory, timing = {}, {}
    for length in lengths:
        log(f"length {length}: memory (load {_load()})")
        fits = []
        for name in variants:
            res = _run_worker("memory", name, length, args, timeout=args.timeout)
            memory[name, length] = res
            log(f"  {name:10s} peak {_mib(res.get('peak'))} MiB  {'ok' if res.get('ok') else res.get('error')}")
            if res.get("ok"):
                fits.append(name)
        if not fits:
            continue
        load_before = _load(short=True)
        res = _run_worker("time", ",".join(fits), length, args, timeout=args.timeout)
        res = res if "error" not in res else {}
        for name in fits:
            if name in res:
                timing[name, length] = dict(res[name], load=f"{load_before}-{_load(short=True)}")
        log(f"  timed {','.join(fits)} (load {load_before} -> {_load()})")
        for name in fits:
            t = timing.get((name, length))
            if t:
                total = [f + b for f, b in zip(t["fwd"], t["bwd"])]
                log(f"  {name:10s} first {t['first_s']:.3f} s  median {statistics.median(total):.3f} s")
    return memory, timing


def _capacity(args, log) -> dict:
    found = {}
    for name in args.capacity_variants.split(","):
        length, rows = 1024, []
        while length <= args.capacity_max:
            res = _run_worker(
                "memory", name, length, args, cap_gib=args.budget_gib, timeout=args.capacity_timeout, calls=1
            )
            rows.append((length, res))
            log(
                f"  capacity {name:10s} {length:7d}: peak {_mib(res.get('peak'))} MiB, "
                f"{res.get('wall_s', 0):.0f} s, {'ok' if res.get('ok') else res.get('error')}"
            )
            if not res.get("ok"):
                break
            length *= 2
        found[name] = rows
    return found


def _table(args, lengths, variants, memory, timing) -> list[str]:
    lines = [
        "| length | variant | density | build s | first s | fwd+bwd median s | min-max | fwd s | bwd s "
        "| vs dense | vs dense-math | peak MiB | vs dense | bytes/token | load 1 min |",
        "| " + " | ".join(["---"] * 15) + " |",
    ]
    for length in lengths:

        def med(name):
            t = timing.get((name, length))
            return None if t is None else statistics.median([f + b for f, b in zip(t["fwd"], t["bwd"])])

        dense_t, math_t = med("dense"), med("dense-math")
        dense_m = memory.get(("dense", length), {})
        for name in variants:
            m, t = memory.get((name, length), {}), timing.get((name, length))
            peak = m.get("peak") if m.get("ok") else None
            density = (t or m).get("density")
            row = [str(length), name, "-" if density is None else f"{density:.3f}"]
            if t is None:
                why = m.get("error", "not run")
                row += ["-", "-", f"skipped ({why})", "-", "-", "-", "-", "-"]
            else:
                total = [f + b for f, b in zip(t["fwd"], t["bwd"])]
                mid, lo, hi = _median_spread(total)
                row += [
                    f"{t['build_s']:.3f}",
                    f"{t['first_s']:.3f}",
                    f"{mid:.3f}",
                    f"{lo:.3f}-{hi:.3f}",
                    f"{statistics.median(t['fwd']):.3f}",
                    f"{statistics.median(t['bwd']):.3f}",
                    "-" if dense_t is None else f"{mid / dense_t:.3f}",
                    "-" if math_t is None else f"{mid / math_t:.3f}",
                ]
            dense_peak = dense_m.get("peak") if dense_m.get("ok") else None
            row += [
                _mib(peak) if peak is not None else f"> cap ({_mib(m.get('peak'))} at failure)",
                "-" if peak is None or not dense_peak else f"{peak / dense_peak:.2f}",
                "-" if peak is None else f"{peak / length:.0f}",
                (t or {}).get("load", "-"),
            ]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def _dense_noise(lengths, timing) -> list[str]:
    lines = []
    for length in lengths:
        t = timing.get(("dense", length))
        if t:
            total = [f + b for f, b in zip(t["fwd"], t["bwd"])]
            first = [x for x, s in zip(total, t["dense_slot"]) if s == "first"]
            last = [x for x, s in zip(total, t["dense_slot"]) if s == "last"]
            lines.append(
                f"- {length}: dense at the start of each round {', '.join(f'{x:.3f}' for x in first)}; "
                f"at the end {', '.join(f'{x:.3f}' for x in last)}"
            )
    return lines


def _goals(args, lengths, memory, timing, capacity) -> list[str]:
    def med(name, length):
        t = timing.get((name, length))
        return None if t is None else statistics.median([f + b for f, b in zip(t["fwd"], t["bwd"])])

    lines = []
    target = 8192 if 8192 in lengths else max(lengths)
    lf, dn = med("longformer", target), med("dense", target)
    if lf is not None and dn is not None:
        verdict = "met" if lf / dn <= 0.3 else "NOT met"
        lines.append(
            f"- longformer at {target} <= 0.3x dense time: **{verdict}** ({lf:.3f} s vs {dn:.3f} s, {lf / dn:.3f}x)"
        )
    worst = [(med(n, L) / med("dense", L), n, L) for (n, L) in timing if n in LAYOUTS and med("dense", L)]
    if worst:
        ratio, name, length = max(worst)
        slow = sorted((f"{n}@{L} {r:.2f}x" for r, n, L in worst if r > 1.1))
        lines.append(
            f"- no layout slower than 1.1x dense: **{'met' if ratio <= 1.1 else 'NOT met'}** (worst "
            f"{name} at {length}: {ratio:.3f}x" + (f"; over 1.1x: {', '.join(slow)}" if slow else "") + ")"
        )
    for name in [n for n in LAYOUTS + BASELINES if any((n, L) in memory for L in lengths)]:
        per = [(L, memory[name, L]["peak"]) for L in lengths if memory.get((name, L), {}).get("ok")]
        if len(per) >= 2:
            (l0, p0), (l1, p1) = per[-2], per[-1]
            growth = (p1 / p0) / (l1 / l0)
            lines.append(
                f"- peak memory of {name}: {', '.join(f'{L}: {_mib(p)} MiB' for L, p in per)}; "
                f"last doubling x{p1 / p0:.2f} ({'linear' if growth <= 1.15 else 'faster than linear'})"
            )
    if capacity:
        best = {}
        for name, rows in capacity.items():
            ok = [L for L, r in rows if r.get("ok")]
            best[name] = max(ok) if ok else 0
            stop = next((f"{L}: {r.get('error')}" for L, r in rows if not r.get("ok")), "none up to the max")
            lines.append(
                f"- longest trainable within {args.budget_gib:g} GiB, {name}: {best[name]} (first failure {stop})"
            )
        for base in BASELINES:
            for name in best:
                if name in LAYOUTS and best.get(base):
                    ratio = best[name] / best[base]
                    lines.append(
                        f"- {name} / {base} trainable length: {ratio:.1f}x "
                        f"(**{'met' if ratio >= 10 else 'NOT met'}** against >= 10x)"
                    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"any of {','.join(LAYOUTS)}")
    parser.add_argument("--baselines", default=",".join(BASELINES), help="dense, dense-math, or both")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per length (after the first call)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument(
        "--mem-cap-gib",
        type=float,
        default=6.0,
        help="a variant whose forward+backward needs more is not timed at that length",
    )
    parser.add_argument("--capacity", action="store_true", help="also find the longest trainable length")
    parser.add_argument("--capacity-variants", default="dense,dense-math,longformer")
    parser.add_argument("--budget-gib", type=float, default=2.0, help="memory budget of the capacity search")
    parser.add_argument("--capacity-max", type=int, default=1 << 20)
    parser.add_argument("--capacity-timeout", type=float, default=150.0, help="seconds per capacity attempt")
    parser.add_argument("--profile", action="store_true", help="torch.profiler tables of one forward+backward")
    parser.add_argument("--profile-variants", default="longformer,dense")
    parser.add_argument("--profile-length", type=int, default=None, help="default: the longest of --lengths")
    parser.add_argument("--profile-rows", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per worker process")
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    parser.add_argument("--worker", choices=("memory", "time", "profile"), help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--cap-gib", type=float, default=6.0, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        import torch

        torch.set_num_threads(1)
        work = {"memory": _memory_worker, "time": _time_worker, "profile": _profile_worker}[args.worker]
        print("RESULT " + json.dumps(work(args)), flush=True)
        return

    if args.quick:
        args.lengths, args.repeats = "256,512", 1
        args.capacity_max, args.capacity_timeout = 2048, 60
    lengths = [int(x) for x in args.lengths.split(",")]
    layouts = [x for x in args.layouts.split(",") if x]
    baselines = [x for x in args.baselines.split(",") if x]
    for name in layouts + baselines:
        if name not in LAYOUTS + BASELINES:
            parser.error(f"unknown variant {name!r}")
    variants = baselines + layouts
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    load_start = _load()
    memory, timing = _measure(args, lengths, variants, log)
    capacity = _capacity(args, log) if args.capacity else {}
    profile = {}
    if args.profile:
        profile = _run_worker(
            "profile", args.profile_variants, args.profile_length or max(lengths), args, timeout=args.timeout
        )
    import torch

    report = [
        f"# Block-sparse attention on CPU ({date.today()})",
        "",
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores | torch {torch.__version__} | "
        f"load average (1/5/15 min) at start {load_start}, at end {_load()}",
        "",
        f"Batch 1, {args.heads} heads, head_dim {HEAD_DIM}, fp32, 1 thread, block {BLOCK}, bidirectional; "
        f"{args.repeats} rounds per length; memory cap for the table {args.mem_cap_gib:g} GiB.",
        "",
        "Command: `python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]) + "`",
        "",
    ]
    report += _table(args, lengths, variants, memory, timing)
    report += [
        "",
        "Dense run twice per round (noise):",
        *_dense_noise(lengths, timing),
        "",
        "Goals:",
        *_goals(args, lengths, memory, timing, capacity),
    ]
    if capacity:
        report += [
            "",
            f"Capacity ({args.budget_gib:g} GiB budget, doubling from 1024):",
            "",
            "| variant | length | peak MiB | wall s | result |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, rows in capacity.items():
            for length, res in rows:
                report.append(
                    f"| {name} | {length} | {_mib(res.get('peak'))} | {res.get('wall_s', 0):.0f} | "
                    f"{'ok' if res.get('ok') else res.get('error')} |"
                )
    tables = profile.items() if isinstance(profile, dict) and "error" not in profile else []
    for name, table in tables:
        report += [
            "",
            f"Profile, {name} at {args.profile_length or max(lengths)} (one forward+backward):",
            "",
            "```",
            table,
            "```",
        ]
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
