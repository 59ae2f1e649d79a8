"""Pipeline-parallel step time, idle time and memory: shardwise's PipelineEngine (1F1B, zero-bubble,
interleaved and GPipe schedules) against DeepSpeed's PipelineEngine, in one run, rounds alternating
the order.

A GPT-like stack written as a list of ``LayerSpec`` s: token embedding (+ learned positions),
``--blocks`` pre-LN residual blocks of LayerNorm + an attention-free MLP (width ``--width``,
``--mlp-ratio`` x wider inside), a final LayerNorm + output head, and a cross-entropy loss_fn. Two
pipeline stages on 2 CPU ranks (gloo, one thread each), ``--micro-batch`` rows per micro-batch,
``--micro-batches`` micro-batches per ``train_batch`` (gradient_accumulation_steps), fp32, SGD with
momentum. Both libraries build the same layers with ``seed_layers=True, base_seed=1234`` and
``partition_method="uniform"`` (embedding + 4 blocks | 4 blocks + head), and read the same
micro-batches, so their first losses agree::

    python bench/bench_pipeline.py --rounds 2 --out bench/results/<date>-cpu-pipeline.md

Variants: ``shardwise-default`` (no ``pipeline.schedule``: the engine's default), ``shardwise-1f1b``,
``shardwise-1f1b_split``, ``shardwise-zero_bubble``, ``shardwise-interleaved`` (two chunks per
stage, ``PipelineModule(virtual_stages=2)``: layers cut uniformly into 4 chunks), ``shardwise-gpipe``
(``"pipeline": {"schedule": ...}``; a suffix ``@gloo`` sends stage-to-stage transfers through gloo
instead of shared memory, ``SHARDWISE_SHM_P2P=0``), ``torch-1f1b`` and ``torch-gpipe``
(``torch.distributed.pipelining``'s ``PipelineStage`` with ``Schedule1F1B`` / ``ScheduleGPipe`` on
the same layers, not timed per action) and ``deepspeed`` (``deepspeed.pipe``, its own interpreter
``--ds-python``; its only schedule, ``TrainSchedule``, is 1F1B). A suffix ``+<method>`` before any
``@gloo`` sets ``partition_method`` (default ``uniform``): ``+parameters`` (both libraries),
``+profile`` (shardwise: each layer timed on the first micro-batch, ``partition_sample``). Each is
launched under
``torch.distributed.run`` (the launcher and report helpers are bench_tensor_parallel.py's).

Idle time: the bench wraps each engine's per-action handlers (shardwise's ``_runner.HANDLERS``
entries for Forward/Backward/BackwardInput/BackwardWeight/Recv*/Send*; DeepSpeed's
``_INSTRUCTION_MAP`` entries) with timers. Per stage and step: "wait" = time inside receives and
sends, "compute" = time inside forwards and backwards; measured idle = 1 - compute / step time
(everything that is not model compute: waiting, loading, the optimizer step and the loss
broadcast), next to the wait fraction.
The simulator (``shardwise.pipe.schedules.simulate(name, 2, M, t_forward=..., t_backward=...)``)
gets each stage's measured per-micro-batch forward and backward times (for the zero-bubble
schedule the input and weight halves separately; for the interleaved one half of each, per chunk),
so its makespan is the schedule's bound for these stage costs with free communication and a free
optimizer step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model, median_or_nan  # noqa: E402
from bench_tensor_parallel import REPO, _free_port, _versions  # noqa: E402

WAIT = ("RecvActivation", "RecvGrad", "SendActivation", "SendGrad")
COMPUTE = ("Forward", "Backward", "BackwardInput", "BackwardWeight")
DS_COMPUTE = ("Forward", "Backward")
"""DeepSpeed's schedule has no split backward."""


# -- the model (imported by both interpreters) -------------------------------------------------


def _layers(args, LayerSpec):
    import torch
    from torch import nn

    class Embed(nn.Module):
        def __init__(self, vocab, width, seq):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)

        def forward(self, ids):
            return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))

    class Block(nn.Module):
        def __init__(self, width, ratio):
            super().__init__()
            self.ln = nn.LayerNorm(width)
            self.up, self.down = nn.Linear(width, ratio * width), nn.Linear(ratio * width, width)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.ln(x))))

    class Head(nn.Module):
        def __init__(self, width, vocab):
            super().__init__()
            self.ln, self.out = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

        def forward(self, x):
            return self.out(self.ln(x))

    return (
        [LayerSpec(Embed, args.vocab, args.width, args.seq_len)]
        + [LayerSpec(Block, args.width, args.mlp_ratio) for _ in range(args.blocks)]
        + [LayerSpec(Head, args.width, args.vocab)]
    )


def _loss_fn(logits, labels):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _module(args, library_pipe, partition, sample, **extra):
    """The benchmark's 2-stage ``PipelineModule`` of ``library_pipe`` (``shardwise.pipe`` or
    ``deepspeed.pipe``; seeded layers), cut by ``partition`` (``"profile"`` times ``sample``,
    one micro-batch)."""
    LayerSpec, PipelineModule = library_pipe.LayerSpec, library_pipe.PipelineModule  # noqa: N806
    if partition == "profile":
        extra["partition_sample"] = sample
    return PipelineModule(
        layers=_layers(args, LayerSpec),
        num_stages=2,
        loss_fn=_loss_fn,
        seed_layers=True,
        base_seed=1234,
        partition_method=partition,
        **extra,
    )


def _micro_batches(args):
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(args.steps * args.micro_batches):
        ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _timed(fn, name, acc):
    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - start
            acc[name + "#"] += 1

    return wrapper


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    acc: dict[str, float] = defaultdict(float)
    base, _, partition = args.variant.partition("@")[0].partition("+")
    system, _, schedule = base.partition("-")
    partition = partition or "uniform"
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.micro_batches,
        "train_batch_size": args.micro_batch * args.micro_batches,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if system == "deepspeed":
        import deepspeed
        import deepspeed.pipe as pipe_lib
        from deepspeed.runtime.pipe import engine as ds_engine
        from deepspeed.runtime.pipe import schedule as ds_sched

        deepspeed.init_distributed(dist_backend="gloo")
        table = ds_engine.PipelineEngine._INSTRUCTION_MAP
        for name in WAIT + DS_COMPUTE:
            cls = getattr(ds_sched, name + ("Pass" if name in DS_COMPUTE else ""))
            table[cls] = _timed(table[cls], name, acc)
        library = deepspeed
    elif system == "torch":
        dist.init_process_group("gloo")
        engine, n_params = _torch_pipelining(args, schedule, rank)
    else:
        import shardwise
        import shardwise.pipe as pipe_lib
        from shardwise.pipe import _actions as sw_actions
        from shardwise.pipe._runner import HANDLERS

        dist.init_process_group("gloo")
        for name in WAIT + COMPUTE:
            kind = getattr(sw_actions, name)
            HANDLERS[kind] = _timed(HANDLERS[kind], name, acc)
        config["pipeline"] = {} if schedule == "default" else {"schedule": schedule}
        library = shardwise
    data = _micro_batches(args)
    if system != "torch":
        chunks = {"virtual_stages": 2} if schedule == "interleaved" else {}
        model = _module(args, pipe_lib, partition, data[0], **chunks)
        parts = list(model.parts)
        n_params = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        engine, _, _, _ = library.initialize(model=model, optimizer=optimizer, config=config)
    times, losses, per_step = [], [], []
    for step in range(args.steps):
        acc.clear()
        it = iter(data[step * args.micro_batches : (step + 1) * args.micro_batches])
        dist.barrier()
        start = time.perf_counter()
        loss = engine.train_batch(it)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        per_step.append(dict(acc))
    result = {
        "times": times,
        "losses": losses,
        "acc": per_step,
        "params": n_params,
        "parts": parts if system != "torch" else None,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


class _TorchPipelining:
    """``torch.distributed.pipelining`` on the same layers: a ``train_batch`` like the engines'."""

    def __init__(self, schedule, optimizer, rank: int):
        self.schedule, self.optimizer, self.rank = schedule, optimizer, rank

    def train_batch(self, batches):
        import torch
        import torch.distributed as dist

        batches = list(batches)
        inputs, labels = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
        loss = torch.zeros(1)
        if self.rank == 0:
            self.schedule.step(inputs)
        else:
            losses: list = []
            self.schedule.step(target=labels, losses=losses)
            loss = torch.stack([x.detach() for x in losses]).mean().reshape(1)
        self.optimizer.step()
        self.optimizer.zero_grad()
        dist.broadcast(loss, src=1)  # the batch loss on every rank, as both engines return it
        return loss[0]


def _torch_pipelining(args, schedule: str, rank: int):
    """This rank's stage of the same model under torch's own pipeline schedules: layers
    ``[0, n/2)`` and ``[n/2, n)`` (the uniform partition), each seeded with 1234 + its index
    as ``seed_layers=True`` does, the engines' loss function; torch averages the gradients
    over the micro-batches (``scale_grads``)."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from shardwise.pipe import LayerSpec

    specs = _layers(args, LayerSpec)
    bounds = [0, len(specs) // 2, len(specs)]
    layers = []
    for index in range(bounds[rank], bounds[rank + 1]):
        torch.manual_seed(1234 + index)
        layers.append(specs[index].build())
    module = torch.nn.Sequential(*layers)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    pipe = kind(stage, n_microbatches=args.micro_batches, loss_fn=_loss_fn)
    return _TorchPipelining(pipe, optimizer, rank), sum(p.numel() for p in module.parameters())


# -- driver -------------------------------------------------------------------------------------


def run_variant(args, variant: str) -> dict:
    python = args.ds_python if variant.startswith("deepspeed") else sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "SHARDWISE_ACCELERATOR": "cpu",
            "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
        }
        if variant.endswith("@gloo"):  # stage-to-stage transfers through gloo instead of shared memory
            env["SHARDWISE_SHM_P2P"] = "0"
        cmd = [
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
        for key in ("vocab", "width", "mlp_ratio", "blocks", "seq_len", "micro_batch", "micro_batches", "steps"):
            cmd += ["--" + key.replace("_", "-"), str(getattr(args, key))]
        started = time.perf_counter()
        proc = subprocess.run(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout
        )
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            lines = [ln for ln in proc.stdout.strip().splitlines() if "Error" in ln or "error" in ln]
            return {"error": (lines[-1] if lines else proc.stdout.strip().splitlines()[-1])[:300]}
        ranks = [json.loads(result.with_suffix(f".rank{r}.json").read_text()) for r in range(2)]
    skip, m = args.warmup, args.micro_batches
    times = ranks[0]["times"][skip:]
    median = statistics.median(times)
    stages = []
    for r in ranks:
        steps = list(zip(r["times"][skip:], r["acc"][skip:]))
        stages.append(
            {
                "wait": median_or_nan([sum(a.get(k, 0.0) for k in WAIT) / t for t, a in steps]),
                "idle": median_or_nan([1 - sum(a.get(k, 0.0) for k in COMPUTE) / t for t, a in steps]),
                "fwd": median_or_nan([a.get("Forward", 0.0) / m for _, a in steps]),
                "bwd": median_or_nan([sum(a.get(k, 0.0) for k in COMPUTE[1:]) / m for _, a in steps]),
                # per action: a split schedule may run some backwards whole and some in halves
                **{
                    key: median_or_nan([a.get(name, 0.0) / max(a.get(name + "#", 0), 1) for _, a in steps])
                    for key, name in (
                        ("bwd_input", "BackwardInput"),
                        ("bwd_weight", "BackwardWeight"),
                        ("bwd_whole", "Backward"),
                    )
                },
                "rss_mb": r["rss_mb"],
                "params": r["params"],
            }
        )
    return {
        "median": median,
        "min": min(times),
        "max": max(times),
        "losses": ranks[0]["losses"],
        "stages": stages,
        "parts": ranks[0].get("parts"),
        "wall_s": wall,
    }


def report(args, runs: dict[str, list[dict]], order: list[list[str]]) -> str:
    from shardwise.config._pipeline import DEFAULT_SCHEDULE
    from shardwise.pipe.schedules import simulate

    ok = {v: [r for r in rs if "median" in r] for v, rs in runs.items()}
    med = {v: median_or_nan([r["median"] for r in rs]) for v, rs in ok.items()}
    base = med.get("deepspeed", float("nan"))
    lines = [
        f"## Step time, idle time and memory (round order: {'; '.join(' '.join(o) for o in order)})",
        "",
        "| variant | runs | median s/step | run medians min-max | vs deepspeed | fwd ms/mb (stage 0, 1) "
        "| bwd ms/mb (stage 0, 1) | wait fraction (stage 0, 1) | measured idle (stage 0, 1) "
        "| simulated idle (measured stage costs) | peak RSS MiB (stage 0, 1) | params (stage 0, 1) |",
        "|" + " --- |" * 12,
    ]
    sim_names = {
        "1f1b": "1f1b",
        "gpipe": "gpipe",
        "deepspeed": "1f1b",
        "zero_bubble": "zero_bubble",
        "interleaved": "interleaved",
        "1f1b_split": "1f1b_split",
        "default": DEFAULT_SCHEDULE,
    }
    halves = []
    for v, rs in ok.items():
        if not rs:
            err = runs[v][0].get("error", "no run") if runs[v] else "no run"
            lines.append(f"| {v} | 0 | failed: {err} |" + " |" * 9)
            continue
        st = [[r["stages"][s] for r in rs] for s in range(2)]

        def pair(key, scale=1.0, fmt="{:.0f}"):
            return ", ".join(fmt.format(median_or_nan([x[key] for x in st[s]]) * scale) for s in range(2))

        def per_stage(key, scale=1.0):  # one duration per stage, for the simulator
            return [median_or_nan([x[key] for x in st[s]]) * scale for s in range(2)]

        sched = sim_names[v.partition("@")[0].partition("+")[0].rpartition("-")[2]]
        if sched in ("zero_bubble", "1f1b_split"):
            sim = simulate(
                sched,
                2,
                args.micro_batches,
                t_forward=per_stage("fwd"),
                t_backward_input=per_stage("bwd_input"),
                t_backward_weight=per_stage("bwd_weight"),
                t_backward=per_stage("bwd_whole"),
            )
            halves.append(
                f"- {v}: ms per action, input half (stage 0, 1): {pair('bwd_input', 1000)}; "
                f"weight half: {pair('bwd_weight', 1000)}; whole backward: {pair('bwd_whole', 1000)} "
                "(the first stage's input is token ids, so its whole backward is the weight half)"
            )
        elif sched == "interleaved":  # the timers add up both chunks of a micro-batch
            sim = simulate(
                sched,
                2,
                args.micro_batches,
                t_forward=per_stage("fwd", 0.5),
                t_backward=per_stage("bwd", 0.5),
                virtual_stages=2,
            )
        else:
            sim = simulate(sched, 2, args.micro_batches, t_forward=per_stage("fwd"), t_backward=per_stage("bwd"))
        timed = not v.startswith("torch-")  # torch's schedules are not timed per action
        cells = (
            (
                f"{pair('fwd', 1000)} | {pair('bwd', 1000)} | {pair('wait', fmt='{:.3f}')} "
                f"| {pair('idle', fmt='{:.3f}')} | {sim.idle_fraction:.3f} ({sched}, makespan {sim.makespan:.3f} s)"
            )
            if timed
            else "- | - | - | - | -"
        )
        lines.append(
            f"| {v} | {len(rs)} | {med[v]:.3f} | {min(r['median'] for r in rs):.3f}-{max(r['median'] for r in rs):.3f} "
            f"| {med[v] / base:.3f} | {cells} | {pair('rss_mb')} | {pair('params', fmt='{:,.0f}')} |"
        )
    if halves:
        lines += ["", "Split backward:", ""] + halves
    lines += ["", "Stage boundaries (layer indices; layer 0 is the embedding, the last the head):", ""]
    lines += [f"- {v}: {sorted({str(r.get('parts')) for r in rs})}" for v, rs in ok.items()]
    lines += ["", "First-step losses (rank 0, every run):", ""]
    first = []
    for v, rs in ok.items():
        first += [r["losses"][0] for r in rs]
        lines.append(
            f"- {v}: "
            + ", ".join(f"{r['losses'][0]:.6f}" for r in rs)
            + (f" (then {', '.join(f'{x:.4f}' for x in rs[0]['losses'][1:4])})" if rs else "")
        )
    if first:
        lines.append(f"- largest first-step difference: {max(first) - min(first):.2e}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="shardwise-1f1b,deepspeed,shardwise-zero_bubble,shardwise-interleaved")
    parser.add_argument("--rounds", type=int, default=2, help="odd rounds run the variants in reverse order")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--mlp-ratio", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8, help="gradient_accumulation_steps")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="leading steps left out of the median")
    parser.add_argument("--ds-python", default=os.environ.get("DS_PYTHON", "/work/ds-env/bin/python"))
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    started = time.perf_counter()
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
            print(
                "  "
                + (
                    out.get("error")
                    or f"{out['median']:.3f} s/step (run {out['wall_s']:.0f} s), losses {out['losses'][:3]}"
                ),
                file=sys.stderr,
                flush=True,
            )
    text = (
        "\n".join(
            [
                "# Pipeline parallelism: shardwise PipelineEngine against DeepSpeed's",
                "",
                f"{date.today()} | {cpu_model()} ({os.cpu_count()} cores) | {_versions(args.ds_python)} | gloo, fp32",
                "",
                f"Model: embedding (vocab {args.vocab}, width {args.width}) + {args.blocks} blocks (LayerNorm + MLP "
                f"{args.width}->{args.mlp_ratio * args.width}->{args.width}, residual) + LayerNorm/head; sequence "
                f"{args.seq_len}; 2 stages x 1 thread; micro-batch {args.micro_batch}, "
                f"{args.micro_batches} micro-batches per train_batch; SGD momentum 0.9 lr 0.01; median of steps "
                f"{args.warmup + 1}..{args.steps} (rank 0)",
                "",
                report(args, runs, order),
                f"wall time of the benchmark: {time.perf_counter() - started:.0f} s",
            ]
        )
        + "\n"
    )
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
