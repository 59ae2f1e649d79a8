"""Mixture-of-experts step time: shardwise's MoE against DeepSpeed 0.19.8's, in one run.

The MoE GPT of ``examples/moe_gpt.py`` (``gpt_model.GPT`` with every other block's MLP an
``MoE`` layer of MLP experts) trains on 2 ranks (CPU, gloo, fp32, one thread per rank) with
the experts split over both (``ep_size`` 2), ZeRO stage 2, the client
``torch.optim.AdamW(fused=True)`` on each library's MoE param groups
(``split_params_into_different_moe_groups_for_optimizer``) and gradient clipping 1.0. Every
variant builds the model from the same seed (experts seeded by global id) and reads the
same byte-corpus rows; each is launched with ``python -m torch.distributed.run
--nproc_per_node 2``, rounds alternating the order::

    python bench/bench_moe.py --rounds 3 --out bench/results/<date>-cpu-moe.md

Variants (``--variants``):

- ``shardwise-cap`` / ``deepspeed-cap``: ``drop_tokens=True`` at ``--capacity`` (1.25).
- ``shardwise-dropless`` / ``deepspeed-dropless``: ``drop_tokens=False``. shardwise moves
  and computes exactly the routed tokens; DeepSpeed pads every expert to the largest
  expert's count over the expert-parallel group.
- ``ddp-dense``: PyTorch DDP of the dense ``gpt_model.GPT`` of the same shape (one MLP per
  token where the MoE model runs k experts): a reference, not a peer.

Each step also records, on rank 0: the time blocked in ``torch.distributed.all_to_all_single``
(both libraries' token exchange goes through it; wrapped before either library is imported,
and completed inside the wrapper, which both libraries would wait for at once anyway), the
forward time of the MoE layers (module hooks), and the routes dropped by capacity.
``--profile`` adds a torch.profiler table of two steps (rank 0) per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from _machine import cpu_model, median_or_nan

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- worker: one rank of one variant ------------------------------------------------------------


class _A2AClock:
    """Calls and seconds of ``torch.distributed.all_to_all_single`` (an async call is waited
    for inside, so its seconds are the whole exchange)."""

    def __init__(self):
        self.calls, self.seconds, self.skew = 0, 0.0, 0.0

    def install(self, *, barrier: bool) -> None:
        """With ``barrier``, each exchange first waits for the whole group at a barrier,
        timed apart (``skew``: the wait for the slowest rank to arrive), so ``seconds``
        is the exchange alone."""
        import torch.distributed as dist

        orig = dist.all_to_all_single

        def all_to_all_single(*args, **kwargs):
            if barrier:
                start = time.perf_counter()
                dist.barrier(group=kwargs.get("group"))
                self.skew += time.perf_counter() - start
            start = time.perf_counter()
            work = orig(*args, **kwargs)
            if work is not None:
                work.wait()
            self.calls += 1
            self.seconds += time.perf_counter() - start
            return work

        dist.all_to_all_single = all_to_all_single


def _settings(args, variant: str):
    from moe_gpt import MoESettings

    return MoESettings(
        num_experts=args.experts,
        k=args.k,
        ep_size=args.ep,
        capacity_factor=args.capacity,
        min_capacity=4,
        drop_tokens=not variant.endswith("dropless"),
        every=args.moe_every,
        second_expert_sampling=args.second_sampling,
    )


def build_model(args, variant: str, rank: int):
    import torch
    from gpt_model import GPT, GPTConfig
    from moe_gpt import MoEGPT

    config = GPTConfig(
        vocab_size=256,
        width=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        seq_len=args.seq_len,
        tie_weights=False,
    )
    torch.manual_seed(0)
    if variant == "ddp-dense":
        return GPT(config)
    if variant.startswith("deepspeed"):
        from deepspeed.moe.layer import MoE
    else:
        from shardwise.moe.layer import MoE
    return MoEGPT(config, _settings(args, variant), MoE, expert_rank=rank % args.ep, seed=0)


def batches(args, rank: int, world: int) -> list:
    """This rank's ``(x, y)`` micro-batches: rows ``(step * world + rank) * micro_batch ..``
    of the byte corpus, the same for every variant."""
    import torch
    from gpt_model import ByteBlocks, byte_corpus

    data = ByteBlocks(byte_corpus(max_bytes=2_000_000), seq_len=args.seq_len)
    out = []
    for step in range(args.steps):
        first = (step * world + rank) * args.micro_batch
        rows = [data[(first + i) % len(data)] for i in range(args.micro_batch)]
        out.append(tuple(torch.stack(t) for t in zip(*rows)))
    return out


def _engine(args, variant: str, model):
    """``(forward, backward, step)`` of the variant's training loop."""
    import torch

    system = variant.split("-")[0]
    if system == "ddp":
        module = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

        def step():
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        return module, lambda loss: loss.backward(), step
    library = __import__(system)
    split = __import__(f"{system}.moe.utils", fromlist=["x"]).split_params_into_different_moe_groups_for_optimizer
    groups = split({"params": list(model.parameters()), "name": "dense-params"})
    optimizer = torch.optim.AdamW(groups, lr=1e-3, fused=True)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = library.initialize(model=model, optimizer=optimizer, config=config)
    return engine, engine.backward, engine.step


def _moe_forward_clock(model) -> list:
    """Hooks adding each MoE layer's forward seconds to ``clock[0]``."""
    clock, started = [0.0], {}
    for layer in model.moe_layers() if hasattr(model, "moe_layers") else []:
        layer.register_forward_pre_hook(lambda m, a: started.__setitem__(m, time.perf_counter()))
        layer.register_forward_hook(
            lambda m, a, o: clock.__setitem__(0, clock[0] + time.perf_counter() - started.pop(m))
        )
    return clock


def worker(args) -> None:
    a2a = _A2AClock()
    a2a.install(barrier=args.a2a_barrier)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.variant.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    model = build_model(args, args.variant, rank)
    rows = batches(args, rank, world)
    moe_clock = _moe_forward_clock(model)
    forward, backward, step = _engine(args, args.variant, model)
    settings = None if args.variant == "ddp-dense" else _settings(args, args.variant)
    from moe_gpt import dropped_routes

    record = {
        "times": [],
        "phases": [],
        "losses": [],
        "a2a_s": [],
        "a2a_calls": [],
        "a2a_skew_s": [],
        "cpu_s": [],
        "thread_s": [],
        "moe_fwd_s": [],
        "dropped": [],
    }
    profile, prof = None, None
    for i, (x, y) in enumerate(rows):
        if args.profile and i == args.warmup:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        a2a.calls, a2a.seconds, a2a.skew, moe_clock[0] = 0, 0.0, 0.0, 0.0
        start, cpu_start, thread_start = time.perf_counter(), time.process_time(), time.thread_time()
        loss = forward(x, y)
        t_forward = time.perf_counter()
        backward(loss)
        t_backward = time.perf_counter()
        step()
        end = time.perf_counter()
        record["times"].append(end - start)
        record["cpu_s"].append(time.process_time() - cpu_start)
        record["thread_s"].append(time.thread_time() - thread_start)
        record["phases"].append((t_forward - start, t_backward - t_forward, end - t_backward))
        record["losses"].append(loss.item())
        record["a2a_s"].append(a2a.seconds)
        record["a2a_calls"].append(a2a.calls)
        record["a2a_skew_s"].append(a2a.skew)
        record["moe_fwd_s"].append(moe_clock[0])
        record["dropped"].append(dropped_routes(model.exp_counts, settings) if settings else (0, 0))
        if prof is not None and i == args.warmup + 1:
            prof.__exit__(None, None, None)
            profile = prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=args.profile_rows, max_name_column_width=60
            )
            prof = None
    record["profile"] = profile
    record["params"] = sum(p.numel() for p in model.parameters())
    Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads sometimes abort it after a clean run


# -- driver -------------------------------------------------------------------------------------

_MODEL_FLAGS = ("hidden", "layers", "heads", "seq_len", "micro_batch", "experts", "k", "ep", "capacity")
_MODEL_FLAGS += ("moe_every", "stage", "steps", "warmup")


def run_variant(args, variant: str) -> dict:
    python = args.ds_python if variant.startswith("deepspeed") else sys.executable
    if not Path(python).exists():
        return {"error": f"interpreter {python} not found (see bench/README.md)"}
    flags = [f for name in _MODEL_FLAGS for f in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    flags += ["--profile", "--profile-rows", str(args.profile_rows)] if args.profile else []
    flags += [] if args.second_sampling else ["--no-second-sampling"]
    flags += ["--a2a-barrier"] if args.a2a_barrier else []
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result"
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "DS_ACCELERATOR": "cpu",
                "SHARDWISE_ACCELERATOR": "cpu",
                "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
            }
            cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
            cmd += ["--master_port", str(_free_port()), __file__, "--worker", "--variant", variant]
            cmd += ["--result", str(result), *flags]
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
            return {"error": (lines[-1] if lines else proc.stdout.strip().splitlines()[-1])[:300]}
    return _summary(args, ranks, wall)


def _summary(args, ranks: list[dict], wall: float) -> dict:
    timed = slice(args.warmup + (2 if args.profile else 0), None)
    r0 = ranks[0]
    times = r0["times"][timed]
    steps = range(*timed.indices(len(r0["times"])))
    return {
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
        "phases": [statistics.median(p[k] for p in r0["phases"][timed]) for k in range(3)],
        "a2a_s": statistics.median(r0["a2a_s"][timed]),
        "a2a_calls": statistics.median(r0["a2a_calls"][timed]),
        "a2a_skew_s": statistics.median(r0["a2a_skew_s"][timed]),
        "moe_fwd_s": statistics.median(r0["moe_fwd_s"][timed]),
        # CPU seconds per step of each rank's main thread (the model's compute; gloo's threads
        # left out) and of its process, mean of the ranks: the work done, less sensitive than
        # wall time to the other processes on the machine
        "thread_s": statistics.median(statistics.fmean(r["thread_s"][i] for r in ranks) for i in steps),
        "cpu_s": statistics.median(statistics.fmean(r["cpu_s"][i] for r in ranks) for i in steps),
        # dropped routes per step, summed over the MoE layers and both ranks
        "dropped": statistics.fmean(sum(r["dropped"][i][0] for r in ranks) for i in range(len(r0["times"]))),
        "routes": statistics.fmean(sum(r["dropped"][i][1] for r in ranks) for i in range(len(r0["times"]))),
        "losses": [statistics.fmean(v) for v in zip(*(r["losses"] for r in ranks))],
        "params": [r["params"] for r in ranks],
        "profile": r0["profile"],
        "wall_s": wall,
    }


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


def _pair_ratios(runs: dict, a: str, b: str, key: str = "median") -> list[float]:
    return [x[key] / y[key] for x, y in zip(runs.get(a, []), runs.get(b, [])) if key in x and key in y]


def report(args, runs: dict[str, list[dict]], order: list[list[str]]) -> str:
    ok = {v: [r for r in rs if "median" in r] for v, rs in runs.items()}
    lines = [
        f"## Step time, 2 ranks, ep {args.ep} (round order: {'; '.join(' '.join(o) for o in order)})",
        "",
        "| variant | runs | median s/step | run medians min-max | all steps min-max | CPU s/step main thread (process) "
        "| forward / backward / step s "
        "| all-to-all s/step (calls) | all-to-all share | wait for peer at barrier s/step "
        "| MoE forward s/step | dropped routes/step (of) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant, rs in runs.items():
        good = ok[variant]
        if not good:
            lines.append(f"| {variant} | error: {rs[0].get('error') if rs else '?'} | | | | | | | | | | |")
            continue
        med = median_or_nan([r["median"] for r in good])
        a2a = median_or_nan([r["a2a_s"] for r in good])
        f, b, s = (median_or_nan([r["phases"][k] for r in good]) for k in range(3))
        lines.append(
            f"| {variant} | {len(good)} | {med:.3f} | {min(r['median'] for r in good):.3f}-"
            f"{max(r['median'] for r in good):.3f} | {min(r['min'] for r in good):.3f}-"
            f"{max(r['max'] for r in good):.3f} | {median_or_nan([r['thread_s'] for r in good]):.3f} "
            f"({median_or_nan([r['cpu_s'] for r in good]):.3f}) "
            f"| {f:.3f} / {b:.3f} / {s:.3f} "
            f"| {a2a:.3f} ({good[0]['a2a_calls']:.0f}) | {a2a / med:.1%} "
            f"| {median_or_nan([r['a2a_skew_s'] for r in good]):.3f} "
            f"| {median_or_nan([r['moe_fwd_s'] for r in good]):.3f} "
            f"| {good[0]['dropped']:.1f} ({good[0]['routes']:.0f}) |"
        )
    lines += [
        "",
        "Paired ratios of median step time (same round, so the same machine load), and of main-thread CPU s/step:",
        "",
    ]
    for a, b in (
        ("shardwise-cap", "deepspeed-cap"),
        ("shardwise-dropless", "deepspeed-dropless"),
        ("shardwise-dropless", "shardwise-cap"),
        ("shardwise-dropless", "deepspeed-cap"),
        ("deepspeed-dropless", "deepspeed-cap"),
        ("shardwise-cap", "ddp-dense"),
    ):
        pairs, cpu = _pair_ratios(runs, a, b), _pair_ratios(runs, a, b, "thread_s")
        if pairs:
            lines.append(
                f"- {a} / {b}: median {statistics.median(pairs):.3f} (rounds: {', '.join(f'{p:.3f}' for p in pairs)}); "
                f"main-thread CPU {statistics.median(cpu):.3f} (rounds: {', '.join(f'{p:.3f}' for p in cpu)})"
            )
    lines += [
        "",
        f"Loss of the first {args.loss_steps} steps (first run; mean of the two ranks' losses, aux loss included):",
        "",
        "| variant | " + " | ".join(f"step {i + 1}" for i in range(args.loss_steps)) + " |",
        "| --- |" + " --- |" * args.loss_steps,
    ]
    for variant, rs in ok.items():
        if rs:
            lines.append(f"| {variant} | " + " | ".join(f"{x:.6f}" for x in rs[0]["losses"][: args.loss_steps]) + " |")
    for a, b in (("shardwise-cap", "deepspeed-cap"), ("shardwise-dropless", "deepspeed-dropless")):
        if ok.get(a) and ok.get(b):
            diff = max(abs(x - y) for x, y in zip(ok[a][0]["losses"], ok[b][0]["losses"]))
            lines.append(f"\nmax |loss {a} - loss {b}| over all {args.steps} steps: {diff:.2e}")
    for variant, rs in ok.items():
        if args.profile and rs and rs[0].get("profile"):
            lines += ["", f"Profile of {variant} (rank 0, two steps, by self CPU time):", "", "```"]
            lines += [rs[0]["profile"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="shardwise-cap,deepspeed-cap,shardwise-dropless,deepspeed-dropless")
    parser.add_argument("--rounds", type=int, default=3, help="each round runs every variant; odd rounds reversed")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per rank per step")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--capacity", type=float, default=1.25)
    parser.add_argument("--moe-every", type=int, default=2, help="an MoE MLP in every n-th block")
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage (0-2)")
    parser.add_argument(
        "--no-second-sampling",
        dest="second_sampling",
        action="store_false",
        help="top2_2nd_expert_sampling=False: no Gumbel noise, so both libraries route alike and losses compare",
    )
    parser.add_argument(
        "--a2a-barrier",
        action="store_true",
        help="a timed barrier before each all-to-all: the wait for the slower rank apart from the exchange",
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="leading steps left out of the median")
    parser.add_argument("--loss-steps", type=int, default=5)
    parser.add_argument("--ds-python", default=os.environ.get("DS_PYTHON", "/work/ds-env/bin/python"))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--profile", action="store_true", help="torch.profiler table of two steps per variant")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
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
            summary = out.get("error") or f"{out['median']:.3f} s/step (run {out['wall_s']:.0f} s)"
            print(f"  {summary}", file=sys.stderr, flush=True)
    header = [
        "# Mixture of experts: shardwise MoE against DeepSpeed MoE",
        "",
        f"{date.today()} | {cpu_model()} ({os.cpu_count()} cores) | {_versions(args.ds_python)} | gloo, fp32 | "
        f"load average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}",
        "",
        f"MoE GPT (examples/moe_gpt.py): vocab 256 (bytes), hidden {args.hidden}, {args.layers} layers, "
        f"{args.heads} heads, sequence {args.seq_len}; an MoE MLP in every {args.moe_every}. block, "
        f"{args.experts} experts (4x MLP), top-{args.k}, ep {args.ep}, capacity factor {args.capacity} "
        f"(min 4), top2_2nd_expert_sampling {args.second_sampling}; {args.micro_batch} rows per rank per step; "
        f"ZeRO {args.stage}, AdamW (torch, fused) lr 1e-3, clipping 1.0; 2 ranks x 1 thread; "
        f"median of steps {args.warmup + 1}..{args.steps}",
        "",
    ]
    text = "\n".join(header) + "\n" + report(args, runs, order)
    text += f"\nwall time of the benchmark: {time.perf_counter() - started:.0f} s\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
