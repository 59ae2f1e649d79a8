"""Serving load: the batching engine against one-at-a-time and static-batch ``generate``, the
effect of chunked prefill on everyone's next token, and a long run with aborted clients.

A Llama built from a config (``--hidden``, ``--layers``; random weights, fp32, CPU, one
thread) serves requests from concurrent clients in one process (the engine's own thread;
no HTTP, so the engine alone is measured). Sections (``--sections``):

- ``clients``: ``--clients`` requests at once (prompts of ``--prompt`` tokens, ``--new``
  new tokens each, greedy, no end-of-sequence): the total time through the batching engine,
  through ``SequentialEngine`` (one request at a time, like a loop of ``generate``), and
  through ``generate`` on static batches of ``--static-batch`` left-padded prompts; time to
  first token and time per output token (p50 / p99).
- ``chunked``: ``--clients`` short requests decoding while ``--long`` requests with
  ``--long-prompt``-token prompts arrive; p99 time per output token of the short requests
  with chunked prefill (``--budget`` tokens per forward) and without (a budget that takes a
  whole long prompt in one forward).
- ``aborts``: ``--requests`` requests from ``--clients`` clients, 10 % of them cancelled after
  their first tokens; cache use at the end and resident memory before and after::

    python bench/bench_serve.py --out bench/results/<date>-cpu-serve.md
    python bench/bench_serve.py --quick
"""

from __future__ import annotations

import argparse
import random
import resource
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
    """Submit every prompt from its own client thread; per request: TTFT and the gaps
    between its tokens."""
    from shardwise.serve import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    ttft, gaps, lock = [], [], threading.Lock()

    def client(i, prompt):
        if stagger is not None:
            time.sleep(stagger(i))
        start = time.perf_counter()
        stream = engine.submit(prompt, params)
        last, mine = None, []
        for n, event in enumerate(stream.events(timeout=600)):
            now = time.perf_counter()
            if event.finished:
                break
            if last is None:
                with lock:
                    ttft.append(now - start)
            else:
                mine.append(now - last)
            last = now
            if cancel_after is not None and cancel_after(i) and n == 2:
                stream.cancel()
        with lock:
            gaps.extend(mine)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"total": time.perf_counter() - start, "ttft": ttft, "gaps": gaps}


def _static_generate(model, prompts, new_tokens, batch) -> float:
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i : i + batch])
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    return time.perf_counter() - start


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
                result = _drive(engine, prompts, args.new)
                rows.append((round_, name, result))
            static = _static_generate(model, prompts, args.new, args.static_batch)
            rows.append((round_, f"static generate x{args.static_batch}", {"total": static, "ttft": [], "gaps": []}))
    finally:
        batching.shutdown()
        sequential.shutdown()
    lines = [
        f"## {args.clients} concurrent clients: prompt {args.prompt}, {args.new} new tokens, greedy",
        "",
        "| round | engine | total s | tokens/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for round_, name, r in rows:
        tokens = args.clients * args.new
        ttft = f"{1e3 * _percentile(r['ttft'], 50):.0f} / {1e3 * _percentile(r['ttft'], 99):.0f}" if r["ttft"] else "-"
        tpot = f"{1e3 * _percentile(r['gaps'], 50):.1f} / {1e3 * _percentile(r['gaps'], 99):.1f}" if r["gaps"] else "-"
        lines.append(f"| {round_} | {name} | {r['total']:.2f} | {tokens / r['total']:.0f} | {ttft} | {tpot} |")
    medians = {}
    for name in {n for _, n, _ in rows}:
        medians[name] = statistics.median(r["total"] for _, n, r in rows if n == name)
    seq, batch = medians["sequential engine"], medians["batching engine"]
    static = medians[f"static generate x{args.static_batch}"]
    lines += [
        "",
        f"Medians over {args.rounds} rounds: batching {batch:.2f} s = **{batch / seq:.3f}x** one at a time "
        f"(goal <= 0.25x) and **{static / batch:.2f}x** the throughput of static batches through generate "
        f"(goal >= 1.5x).",
    ]
    return lines


def chunked(args, model) -> list[str]:
    from shardwise.serve._batching import BatchingEngine

    short = _prompts(args.clients, args.prompt, args.vocab, 2)
    long = _prompts(args.long, args.long_prompt, args.vocab, 3)
    lines = [
        f"## Chunked prefill: {args.clients} decoding clients, {args.long} prompts of {args.long_prompt} tokens "
        "arriving meanwhile",
        "",
        "| token budget | short requests' TPOT p50 / p99 ms | long requests' TTFT p50 ms | total s |",
        "| --- | --- | --- | --- |",
    ]
    p99 = {}
    for budget in (args.budget, args.long_prompt + args.clients + 8):
        engine = BatchingEngine(
            model, None, max_num_seqs=args.clients + args.long, token_budget=budget,
            max_model_len=args.long_prompt + args.new + 8,
        )  # fmt: skip
        try:
            _drive(engine, short[:1], 2)
            prompts = short + long
            # the long prompts arrive while the short ones decode
            result = _drive(
                engine, prompts, args.new, stagger=lambda i: 0.0 if i < len(short) else 0.05 * (i - len(short) + 1)
            )
            short_gaps = result["gaps"]  # all requests' gaps; the long ones' are after their prefill
            p99[budget] = _percentile(short_gaps, 99)
            lines.append(
                f"| {budget} | {1e3 * _percentile(short_gaps, 50):.1f} / {1e3 * p99[budget]:.1f} | "
                f"{1e3 * _percentile(result['ttft'][-args.long :], 50):.0f} | {result['total']:.2f} |"
            )
        finally:
            engine.shutdown()
    chunked_p99, whole_p99 = p99[args.budget], p99[args.long_prompt + args.clients + 8]
    ratio = chunked_p99 / whole_p99
    lines += ["", f"p99 time per output token with chunked prefill: **{ratio:.2f}x** without it (goal <= 0.5x)."]
    return lines


def aborts(args, model) -> list[str]:
    from shardwise.serve._batching import BatchingEngine

    engine = BatchingEngine(model, None, max_num_seqs=args.clients, max_queue=args.requests,
                            max_model_len=args.prompt + args.new + 8)  # fmt: skip
    rss = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]
    try:
        rng = random.Random(5)
        aborted = {i for i in range(args.requests) if rng.random() < 0.1}
        for start in range(0, args.requests, args.clients):
            prompts = _prompts(min(args.clients, args.requests - start), args.prompt, args.vocab, 100 + start)
            _drive(engine, prompts, args.new, cancel_after=lambda i, s=start: s + i in aborted)
            rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        metrics = engine.metrics()
    finally:
        engine.shutdown()
    return [
        f"## {args.requests} requests, {len(aborted)} cancelled after their first tokens",
        "",
        f"Cache use at the end: {metrics.kv_cache_usage_perc:.3f}; running {metrics.num_requests_running}, waiting "
        f"{metrics.num_requests_waiting}; peak resident memory after the first wave {rss[1]:.0f} MiB, after the "
        f"last {rss[-1]:.0f} MiB.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="clients,chunked,aborts")
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
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.clients, args.new, args.rounds = 64, 2, 8, 8, 1
        args.long, args.long_prompt, args.requests, args.vocab = 2, 64, 40, 512
    torch.set_num_threads(1)
    model = _model(args)
    lines = [
        "# Serving on CPU: the batching engine against generate",
        "",
        f"{date.today()} | {cpu_model()} | torch {torch.__version__} | Llama hidden {args.hidden}, "
        f"{args.layers} layers, vocab {args.vocab}, fp32, one thread | `python bench/bench_serve.py`",
        "",
    ]
    for section in args.sections.split(","):
        part = {"clients": clients, "chunked": chunked, "aborts": aborts}[section](args, model) + [""]
        print("\n".join(part), flush=True)
        lines += part
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    main()
