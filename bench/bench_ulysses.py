"""Long sequences: shardwise's DeepSpeed-Ulysses / ALST against DeepSpeed 0.19.8's, in one run.

A Hugging Face Llama built from a config (``--hidden``, ``--layers``, ``--heads``,
``--kv-heads``, ``--intermediate``, ``--vocab``; fp32, ``sdpa`` attention) trains on 2 ranks
(CPU, gloo, one thread per rank) on random token sequences of micro-batch 1, with ZeRO
``--stage`` (2), the client ``torch.optim.AdamW`` and gradient clipping 1.0. Variants
(``--variants``):

- ``ddp``: PyTorch DDP, each rank a whole sequence of its own (twice the tokens per step of
  the sequence-parallel variants, which share one sequence).
- ``shardwise``: the sequence split over both ranks with shardwise's
  ``UlyssesSPAttentionHF.register_with_transformers``, ``UlyssesSPDataLoaderAdapter`` and
  ``shardwise.sequence.loss`` (``causal_lm_loss``, or ``mean_over_sequence`` of the tiled loss).
- ``shardwise-keep``: ``shardwise`` registered with ``keep_attention_outputs=True`` (the
  checkpoint's recompute takes each layer's attention output from its forward; see
  [Note: kept attention outputs]).
- ``deepspeed``: the same recipe with DeepSpeed's classes at the same paths (run with
  ``--ds-python``) and the loss of its ALST tutorial: each rank's mean, weighted by the token
  counts gathered with ``torch.distributed.nn.functional.all_gather``.

Both sequence-parallel variants take the same ALST options: ``--tiles N`` runs every MLP in
N tiles (``TiledMLP``), ``--loss-tiles N`` computes the LM head and the cross-entropy in N
tiles without the whole logits (``TiledFusedLogitsLoss``, reduction "sum" divided by the
token count; shardwise's variant uses its ``fused_causal_lm_loss`` in as many tiles unless
``--shardwise-loss tiled``), ``--checkpoint`` turns on Hugging Face activation checkpointing
(``gradient_checkpointing_enable``, non-reentrant).

Two measurements:

1. Capacity: the longest sequence that trains ``--trial-steps`` (2) steps with every rank's
   peak resident memory (``ru_maxrss``; a thread in each rank also ends a rank at once when
   its high-water mark passes the cap) at most ``--cap-gib``. Lengths double from ``--start``
   and are then bisected to ``--granularity``; every trial is a fresh launch, and one that runs
   past ``--trial-timeout`` counts as not fitting (the report says which).
2. Step time at ``--seq-len`` (a length every variant fits), ``--rounds`` launches per variant
   in alternating order, median of steps after the first; with the time blocked in
   ``torch.distributed.all_to_all_single`` (both libraries' Ulysses exchange goes through it)
   and, with ``--profile``, a torch.profiler table of one more step of rank 0 in the first round.

::

    python bench/bench_ulysses.py --cap-gib 4 --seq-len 4096 --tiles 4 --loss-tiles 4 --checkpoint \\
        --out bench/results/<date>-cpu-ulysses.md
    python bench/bench_ulysses.py --quick      # a tiny model, short sequences, one round
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL_LENGTH, GOAL_TIME = 1.5, 0.85
"""The issue's goals: >= 1.5x DeepSpeed's longest sequence, <= 0.85x its step time."""


# -- worker: one rank of one launch -------------------------------------------------------------


def _high_water_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _watch_cap(cap_gib: float) -> None:
    """End this rank (exit code 3) as soon as its resident high-water mark passes the cap:
    the trial has failed, and its peers are then stopped by the launcher."""
    cap_kib = cap_gib * 2**20

    def watch():
        while True:
            peak = _high_water_kib()
            if peak > cap_kib:
                print(f"OVER_CAP {peak / 2**20:.3f} GiB", file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()


class _A2AClock:
    """Calls and seconds of ``torch.distributed.all_to_all_single`` (waited for inside)."""

    def __init__(self):
        self.calls, self.seconds = 0, 0.0

    def install(self) -> None:
        import torch.distributed as dist

        orig = dist.all_to_all_single

        def all_to_all_single(*args, **kwargs):
            start = time.perf_counter()
            work = orig(*args, **kwargs)
            if work is not None:
                work.wait()
            self.calls += 1
            self.seconds += time.perf_counter() - start
            return work

        dist.all_to_all_single = all_to_all_single


def _library(variant: str):
    """The variant's ``ulysses_sp`` module (None for ddp)."""
    if variant == "ddp":
        return None
    if variant == "deepspeed":
        import deepspeed.runtime.sequence_parallel.ulysses_sp as ulysses_sp
    else:
        import shardwise.runtime.sequence_parallel.ulysses_sp as ulysses_sp
    return ulysses_sp


def build_llama(args):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq_len, 2048),
        attn_implementation="sdpa",
        use_cache=False,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _tile_mlps(llama, tiled_mlp, tiles: int) -> None:
    """Run every ``LlamaMLP`` through the library's ``TiledMLP`` in ``tiles`` tiles."""

    def mlp(module, x):
        return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))

    for layer in llama.model.layers:
        m = layer.mlp
        params = [m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
        m.forward = lambda x, m=m, params=params: tiled_mlp.apply(mlp, m, x, tiles, params)


def _ce_sum(lm_head, hidden, labels):
    import torch.nn.functional as F

    logits = lm_head(hidden).float()  # DeepSpeed's tiled loss passes [tokens, hidden], shardwise's [b, s, hidden]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")


def _loss_module(args, llama, ulysses_sp, group):
    """``llama`` wrapped so that its forward returns the variant's loss of the whole sequence."""
    import torch

    variant = args.variant

    class CausalLMLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.llama = llama

        def forward(self, input_ids, position_ids, shift_labels):
            hidden = self.llama.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
            head = self.llama.lm_head
            tokens = (shift_labels != -100).sum()
            if variant == "shardwise" and not args.loss_tiles:
                from shardwise.sequence.loss import causal_lm_loss

                return causal_lm_loss(head(hidden), shift_labels, group=group)
            if variant == "shardwise" and args.shardwise_loss == "fused":
                from shardwise.sequence.loss import fused_causal_lm_loss

                rows = -(-hidden.shape[0] * hidden.shape[1] // args.loss_tiles)  # the same number of tiles
                return fused_causal_lm_loss(hidden, head, shift_labels, group=group, tile_tokens=rows)
            if args.loss_tiles and ulysses_sp is not None:
                fused = ulysses_sp.TiledFusedLogitsLoss
                loss_sum = fused.apply(_ce_sum, head, hidden, shift_labels, None, args.loss_tiles, [head.weight], "sum")
            else:
                loss_sum = _ce_sum(head, hidden, shift_labels)
            if variant == "shardwise":
                from shardwise.sequence.loss import mean_over_sequence

                return mean_over_sequence(loss_sum, tokens, group=group)
            loss = loss_sum / tokens.clamp_min(1)
            if variant == "ddp":
                return loss
            return _tutorial_weighted_loss(loss, tokens, group)

    return CausalLMLoss()


def _tutorial_weighted_loss(loss, tokens, group):
    """DeepSpeed's ALST tutorial: every rank's mean loss weighted by its token count, gathered
    differentiably over the sequence-parallel group."""
    import torch.distributed.nn.functional as dnn

    losses = dnn.all_gather(loss, group=group)
    counts = dnn.all_gather(tokens, group=group)
    total = sum(lo * n for lo, n in zip(losses, counts) if n > 0)
    return total / max(sum(counts), 1)


def _engine(args, module, mpu):
    """``(forward, backward, step)`` of the variant's training loop."""
    import torch

    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    if args.variant == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(module)

        def step():
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        return ddp, lambda loss: loss.backward(), step
    library = __import__(args.variant)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,
        "sequence_parallel_size": 2,
    }
    engine, _, _, _ = library.initialize(model=module, optimizer=optimizer, config=config, mpu=mpu)
    return engine, engine.backward, engine.step


def _batches(args, rank: int, world: int, ulysses_sp, mpu) -> list[dict]:
    """The launch's micro-batches: random tokens, the sequence ``(step * world + rank)`` of
    this rank (ddp) or every rank's sequence in turn, split by the library's adapter."""
    import torch
    from torch.utils.data import DataLoader

    def sequence(i: int) -> dict:
        ids = torch.randint(0, args.vocab, (args.seq_len,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "position_ids": torch.arange(args.seq_len), "labels": ids.clone()}

    if ulysses_sp is None:
        out = []
        for step in range(args.steps):
            whole = {k: v[None] for k, v in sequence(step * world + rank).items()}
            labels = whole.pop("labels")
            whole["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
            out.append(whole)
        return out
    own = [sequence(i * world + rank) for i in range(-(-args.steps // world))]
    adapter = ulysses_sp.UlyssesSPDataLoaderAdapter(
        DataLoader(own, batch_size=1),
        mpu.get_sequence_parallel_rank(),
        mpu.get_sequence_parallel_group(),
        mpu.get_sequence_parallel_world_size(),
        "cpu",
    )
    return [next(adapter) for _ in range(args.steps)]


def _setup(args, rank: int, world: int):
    """Build the model, the engine and the batches; returns ``(forward, backward, step, batches)``."""
    import torch

    llama = build_llama(args)
    ulysses_sp = _library(args.variant)
    mpu, group = None, None
    if ulysses_sp is not None:
        cls = ulysses_sp.UlyssesSPAttentionHF
        keep = {"keep_attention_outputs": True} if args.keep_attention else {}
        mpu = cls.register_with_transformers(
            llama, "sdpa", 2, 1, seq_length=args.seq_len, seq_length_is_variable=True, **keep
        )
        group = mpu.get_sequence_parallel_group()
        if args.tiles:
            _tile_mlps(llama, ulysses_sp.TiledMLP, args.tiles)
        if args.checkpoint:
            llama.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module = _loss_module(args, llama, ulysses_sp, group)
    module.train()
    forward, backward, step = _engine(args, module, mpu)
    batches = _batches(args, rank, world, ulysses_sp, mpu)
    torch.distributed.barrier()
    return forward, backward, step, batches, sum(p.numel() for p in llama.parameters())


def worker(args) -> None:
    if args.cap_gib and args.enforce_cap:
        _watch_cap(args.cap_gib)
    a2a = _A2AClock()
    a2a.install()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.variant == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    forward, backward, step, batches, params = _setup(args, rank, world)
    record = {"times": [], "cpu_s": [], "phases": [], "losses": [], "a2a_s": [], "a2a_calls": [], "params": params}
    record["setup_hwm_kib"] = _high_water_kib()
    profile = None
    for i, batch in enumerate(batches):
        prof = None
        if args.profile and rank == 0 and i == len(batches) - 1:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        a2a.calls, a2a.seconds = 0, 0.0
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = forward(**batch)
        t_forward = time.perf_counter()
        backward(loss)
        t_backward = time.perf_counter()
        step()
        end = time.perf_counter()
        record["times"].append(end - start)
        record["cpu_s"].append(time.process_time() - cpu_start)
        record["phases"].append((t_forward - start, t_backward - t_forward, end - t_backward))
        record["losses"].append(loss.item())
        record["a2a_s"].append(a2a.seconds)
        record["a2a_calls"].append(a2a.calls)
        if prof is not None:
            prof.__exit__(None, None, None)
            profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
    record["profile"] = profile
    record["peak_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads sometimes abort it after a clean run


# -- driver: launches -----------------------------------------------------------------------------

_MODEL_FLAGS = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "stage", "tiles", "loss_tiles")
_MODEL_FLAGS += ("profile_rows", "shardwise_loss")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command(args, variant: str, seq_len: int, steps: int, result: Path, *, capacity: bool, profile: bool):
    python = args.ds_python if variant == "deepspeed" else sys.executable
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(_free_port()), __file__, "--worker", "--variant", variant, "--result", str(result)]
    cmd += ["--seq-len", str(seq_len), "--steps", str(steps), "--cap-gib", str(args.cap_gib)]
    cmd += [f for name in _MODEL_FLAGS for f in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    cmd += ["--checkpoint"] if args.checkpoint and variant != "ddp" else []
    cmd += ["--enforce-cap"] if capacity else []
    cmd += ["--profile"] if profile else []
    return cmd


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, read from /proc (empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
    found, stack = [], [pid]
    while stack:
        below = children.get(stack.pop(), [])
        found += below
        stack += below
    return found


def launch(args, variant: str, seq_len: int, steps: int, *, capacity: bool, profile: bool = False) -> dict:
    """One launch of 2 ranks; its ranks' records, or ``{"error": ...}`` with ``over_cap`` or
    ``timeout`` set when that is why it failed."""
    python = args.ds_python if variant == "deepspeed" else sys.executable
    if not Path(python).exists():
        return {"error": f"interpreter {python} not found (see bench/README.md)"}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "SHARDWISE_ACCELERATOR": "cpu"}
    if args.malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    # DeepSpeed's ranks must not see shardwise; shardwise's import the worktree's copy
    env["PYTHONPATH"] = "" if variant == "deepspeed" else f"{REPO}:{os.environ.get('PYTHONPATH', '')}"
    timeout = args.trial_timeout if capacity else args.timeout
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result"
            cmd = _command(args, variant, seq_len, steps, result, capacity=capacity, profile=profile)
            started = time.perf_counter()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)  # fmt: skip
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                ranks = _descendants(proc.pid)  # torchrun starts its ranks in sessions of their own
                os.killpg(proc.pid, signal.SIGKILL)
                for pid in ranks:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                proc.communicate()
                return {"error": f"ran past {timeout:.0f} s", "timeout": True, "wall_s": timeout}
            wall = time.perf_counter() - started
            if proc.returncode == 0:
                ranks = [json.loads(result.with_suffix(f".rank{r}.json").read_text()) for r in range(2)]
                return {"ranks": ranks, "wall_s": wall}
            if "EADDRINUSE" in out and attempt < 2:
                continue
            over = [ln for ln in out.splitlines() if ln.startswith("OVER_CAP")]
            if over:
                return {"error": f"rank passed the cap ({over[0].split(' ', 1)[1]})", "over_cap": True, "wall_s": wall}
            lines = [ln for ln in out.splitlines() if ("Error" in ln or "error:" in ln) and "errors.html" not in ln]
            lines = lines or out.splitlines()[-1:]
            return {"error": (lines[-1] if lines else "no output")[:300], "wall_s": wall}
    return {"error": "no free port"}


def _peak_gib(run: dict) -> float:
    return max(r["peak_kib"] for r in run["ranks"]) / 2**20


def _setup_gib(run: dict) -> float:
    return max(r["setup_hwm_kib"] for r in run["ranks"]) / 2**20


# -- driver: the capacity search -----------------------------------------------------------------


def _trial(args, variant: str, seq_len: int, trials: list) -> bool:
    run = launch(args, variant, seq_len, args.trial_steps, capacity=True)
    if "ranks" in run:
        _PARAMS["count"] = run["ranks"][0]["params"]
    fits = "ranks" in run and _peak_gib(run) <= args.cap_gib
    if "ranks" in run:
        note = f"peak {_peak_gib(run):.2f} GiB (setup {_setup_gib(run):.2f})"
    else:
        note = run["error"]
    trials.append((seq_len, fits, note, run.get("wall_s", 0.0)))
    print(f"  {variant} {seq_len}: {'fits' if fits else 'no'} - {note} ({run.get('wall_s', 0):.0f} s)",
          file=sys.stderr, flush=True)  # fmt: skip
    return fits


_PARAMS: dict[str, int] = {}
"""The model's parameter count, from any launch that finished."""


def search(args, variant: str) -> dict:
    """The longest length (a multiple of ``--granularity``, at most ``--max-len``) whose trial fits:
    doubling from ``--start``, then bisection between the last fit and the first failure."""
    trials: list = []
    low, high = 0, None
    length = args.start
    while length <= args.max_len:
        if not _trial(args, variant, length, trials):
            high = length
            break
        low, length = length, length * 2
    if high is None:
        high = min(length, args.max_len + args.granularity)
    while high - low > args.granularity:
        mid = (low + high) // 2 // args.granularity * args.granularity
        if mid in (low, high):
            break
        low, high = (mid, high) if _trial(args, variant, mid, trials) else (low, mid)
    return {"longest": low, "first_failure": high if high <= args.max_len else None, "trials": trials}


# -- driver: step time ----------------------------------------------------------------------------


def _summary(run: dict) -> dict:
    """Medians over the steps after the first, rank 0 (ranks are in lock step)."""
    r0 = run["ranks"][0]
    end = len(r0["times"]) - (1 if r0.get("profile") else 0)
    timed = slice(1, end) if end > 1 else slice(0, end)
    steps = range(*timed.indices(len(r0["times"])))
    return {
        "median": statistics.median(r0["times"][timed]),
        # CPU seconds per step of each rank's process (gloo's threads included), mean of the ranks:
        # the work done, less sensitive than wall time to the other processes on the machine
        "cpu_s": statistics.median(statistics.fmean(r["cpu_s"][i] for r in run["ranks"]) for i in steps),
        "phases": [statistics.median(p[k] for p in r0["phases"][timed]) for k in range(3)],
        "a2a_s": statistics.median(r0["a2a_s"][timed]),
        "a2a_calls": r0["a2a_calls"][-1],
        "losses": [statistics.fmean(v) for v in zip(*(r["losses"] for r in run["ranks"]))],
        "peak_gib": _peak_gib(run),
        "params": r0["params"],
        "profile": r0.get("profile"),
        "wall_s": run["wall_s"],
    }


def step_times(args, variants: list[str]) -> tuple[dict, list]:
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    order = []
    for r in range(args.rounds):
        round_order = variants if r % 2 == 0 else variants[::-1]
        order.append(round_order)
        for variant in round_order:
            # with --profile, the first round runs one more step, profiled and left out of the times
            profile = args.profile and r == 0
            run = launch(args, variant, args.seq_len, args.steps + profile, capacity=False, profile=profile)
            out = _summary(run) if "ranks" in run else run
            runs[variant].append(out)
            note = out.get("error") or f"{out['median']:.2f} s/step, peak {out['peak_gib']:.2f} GiB"
            print(f"round {r + 1}: {variant} at {args.seq_len}: {note}", file=sys.stderr, flush=True)
    return runs, order


# -- driver: the report -----------------------------------------------------------------------------


class _LoadSampler:
    """The 1-minute load average every ``every`` seconds, on a daemon thread."""

    def __init__(self, every: float = 10.0):
        self.samples = [os.getloadavg()[0]]
        threading.Thread(target=self._run, args=(every,), daemon=True).start()

    def _run(self, every: float) -> None:
        while True:
            time.sleep(every)
            self.samples.append(os.getloadavg()[0])

    def text(self) -> str:
        s = self.samples
        return f"1-min load average min {min(s):.2f}, median {statistics.median(s):.2f}, max {max(s):.2f}"


def _versions(ds_python: str) -> str:
    import torch
    import transformers

    parts = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    if Path(ds_python).exists():
        code = "import deepspeed, transformers; print(deepspeed.__version__, transformers.__version__)"
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ""}
        out = subprocess.run([ds_python, "-c", code], capture_output=True, text=True, env=env)
        last = out.stdout.strip().splitlines()[-1].split() if out.returncode == 0 else ["unavailable", "?"]
        parts.append(f"deepspeed {last[0]} (its env: transformers {last[-1]})")
    return ", ".join(parts)


def _ratio_line(name: str, values: list[float], goal: str = "") -> str:
    if not values:
        return f"- {name}: not measured"
    rounds = ", ".join(f"{v:.3f}" for v in values)
    return f"- {name}: median {statistics.median(values):.3f} (rounds: {rounds}){goal}"


def capacity_report(args, found: dict[str, dict]) -> list[str]:
    lines = [
        f"## Longest sequence under {args.cap_gib:g} GiB peak RSS per rank ({args.trial_steps} steps per trial)",
        "",
        "| variant | longest that fits | first that does not | trials: length fits? peak RSS per rank (setup) |",
        "| --- | --- | --- | --- |",
    ]
    for variant, res in found.items():
        trials = "; ".join(f"{n} {'yes' if ok else 'no'} {note}" for n, ok, note, _ in res["trials"])
        fail = res["first_failure"] if res["first_failure"] is not None else f"none up to {args.max_len}"
        lines.append(f"| {variant} | {res['longest']} | {fail} | {trials} |")
    sw, ds = found.get("shardwise"), found.get("deepspeed")
    if sw and ds and ds["longest"]:
        ratio = sw["longest"] / ds["longest"]
        met = "met" if ratio >= GOAL_LENGTH else "NOT met"
        lines += ["", f"shardwise / deepspeed longest length: {ratio:.2f} (goal >= {GOAL_LENGTH}: {met})"]
    if ds and found.get("ddp") and found["ddp"]["longest"]:
        lines.append(f"deepspeed / ddp longest length: {ds['longest'] / found['ddp']['longest']:.2f}")
    return lines


def _time_row(variant: str, good: list[dict], tokens: int) -> str:
    med = statistics.median(r["median"] for r in good)
    f, b, s = (statistics.median(r["phases"][k] for r in good) for k in range(3))
    a2a = statistics.median(r["a2a_s"] for r in good)
    return (
        f"| {variant} | {len(good)} | {med:.3f} | {min(r['median'] for r in good):.3f}-"
        f"{max(r['median'] for r in good):.3f} | {statistics.median(r['cpu_s'] for r in good):.3f} "
        f"| {tokens / med:.0f} | {f:.3f} / {b:.3f} / {s:.3f} "
        f"| {a2a:.3f} ({good[0]['a2a_calls']}) | {a2a / med:.1%} | {max(r['peak_gib'] for r in good):.2f} |"
    )


def time_report(args, runs: dict[str, list[dict]], order: list) -> list[str]:
    lines = [
        f"## Step time at sequence {args.seq_len} (round order: {'; '.join(' '.join(o) for o in order)})",
        "",
        "| variant | runs | median s/step | run medians min-max | CPU s/step per rank | tokens/s (both ranks) "
        "| forward / backward / step s | all-to-all s/step (calls) | all-to-all share | peak RSS GiB per rank |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant, rs in runs.items():
        good = [r for r in rs if "median" in r]
        if not good:
            lines.append(f"| {variant} | error: {rs[0].get('error') if rs else '?'} | | | | | | | | |")
            continue
        tokens = 2 * args.seq_len if variant == "ddp" else args.seq_len
        lines.append(_time_row(variant, good, tokens))

    def paired(a: str, b: str, key: str = "median") -> list[float]:
        pairs = zip(runs.get(a, []), runs.get(b, []))
        return [x[key] / y[key] for x, y in pairs if key in x and key in y]

    def goal(ratios: list[float]) -> str:
        return f" (goal <= {GOAL_TIME}: {'met' if statistics.median(ratios) <= GOAL_TIME else 'NOT met'})"

    lines += ["", "Paired ratios of step time (same round):", ""]
    for variant in ("shardwise", "shardwise-keep"):
        if ratios := paired(variant, "deepspeed"):
            lines.append(_ratio_line(f"{variant} / deepspeed", ratios, goal(ratios)))
    if not any(paired(v, "deepspeed") for v in ("shardwise", "shardwise-keep")):
        lines.append(_ratio_line("shardwise / deepspeed", []))
    note = "deepspeed / ddp (ddp trains two sequences per step, the others one)"
    lines.append(_ratio_line(note, paired("deepspeed", "ddp")))
    lines.append(_ratio_line("shardwise / ddp", paired("shardwise", "ddp")))
    if paired("shardwise-keep", "shardwise"):
        lines.append(_ratio_line("shardwise-keep / shardwise", paired("shardwise-keep", "shardwise")))
    for variant in ("shardwise", "shardwise-keep"):
        if variant == "shardwise" or variant in runs:
            lines.append(_ratio_line(f"CPU s/step, {variant} / deepspeed", paired(variant, "deepspeed", "cpu_s")))
    lines += ["", "Loss per step (first run, mean of the ranks; same data and seed in every variant):", ""]
    for variant, rs in runs.items():
        good = [r for r in rs if "losses" in r]
        if good:
            lines.append(f"- {variant}: " + ", ".join(f"{x:.5f}" for x in good[0]["losses"]))
    for variant, rs in runs.items():
        prof = next((r["profile"] for r in rs if r.get("profile")), None)
        if prof:
            title = f"Profile of {variant} (rank 0, one extra step after the timed ones, by self CPU time):"
            lines += ["", title, "", "```", prof.rstrip(), "```"]
    return lines


def header(args, params: int | None, load: _LoadSampler, started: datetime) -> list[str]:
    from _machine import cpu_model

    alst = f"TiledMLP {args.tiles or 'off'}, TiledFusedLogitsLoss {args.loss_tiles or 'off'}"
    if args.loss_tiles and args.shardwise_loss == "fused":
        alst += f" (shardwise: its fused_causal_lm_loss in the same {args.loss_tiles} tiles)"
    alst += f", activation checkpointing {'on' if args.checkpoint else 'off'}"
    return [
        "# Long sequences: shardwise Ulysses/ALST against DeepSpeed 0.19.8's, and DDP",
        "",
        f"{started:%Y-%m-%d %H:%M} UTC | {cpu_model()} ({os.cpu_count()} cores) | {_versions(args.ds_python)} | "
        f"gloo, fp32 | {load.text()} during the run",
        "",
        f"Llama from a config: vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
        f"({args.kv_heads} key/value), intermediate {args.intermediate}, untied head"
        + (f", {params / 1e6:.1f}M parameters" if params else "")
        + f"; sdpa attention; micro-batch 1 of random tokens; ZeRO {args.stage} (shardwise, DeepSpeed), "
        f"AdamW (torch) lr 1e-4, clipping 1.0; 2 ranks x 1 thread. Sequence-parallel variants (sp 2, so the "
        f"data-parallel size is 1): {alst}. DDP: plain, nothing of ALST.",
        "",
        f"Goals (issue 31): >= {GOAL_LENGTH}x DeepSpeed's longest sequence, <= {GOAL_TIME}x its step time.",
        "",
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="ddp,shardwise,deepspeed")
    parser.add_argument("--quick", action="store_true", help="tiny model, short sequences, one round (< 2 minutes)")
    parser.add_argument("--skip", choices=("capacity", "time"), default=None, help="leave one measurement out")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage of shardwise and DeepSpeed")
    parser.add_argument("--tiles", type=int, default=0, help="TiledMLP tiles (0: untiled MLPs)")
    parser.add_argument("--loss-tiles", type=int, default=0, help="TiledFusedLogitsLoss tiles (0: whole logits)")
    parser.add_argument(
        "--shardwise-loss",
        choices=("fused", "tiled"),
        default="fused",
        help="with --loss-tiles, shardwise's loss: its fused linear cross-entropy (one logits buffer per tile, "
        "gradients in forward) or TiledFusedLogitsLoss as DeepSpeed's variant runs it",
    )
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing (sequence parallel)")
    parser.add_argument("--cap-gib", type=float, default=4.0, help="peak resident memory allowed per rank")
    parser.add_argument("--start", type=int, default=1024, help="first length of the capacity search")
    parser.add_argument("--granularity", type=int, default=1024, help="bisect the capacity to this many tokens")
    parser.add_argument("--max-len", type=int, default=65536, help="longest length the capacity search tries")
    parser.add_argument("--trial-steps", type=int, default=2)
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        help="MALLOC_MMAP_THRESHOLD_ (bytes) of every launch: glibc then returns large freed blocks at once",
    )
    parser.add_argument("--trial-timeout", type=float, default=180, help="seconds; a slower trial counts as no fit")
    parser.add_argument("--seq-len", type=int, default=2048, help="length of the step-time measurement")
    parser.add_argument("--steps", type=int, default=3, help="steps per step-time launch (the first left out)")
    parser.add_argument("--rounds", type=int, default=3, help="step-time launches per variant; odd rounds reversed")
    parser.add_argument("--ds-python", default=os.environ.get("DS_PYTHON", "/work/ds-env/bin/python"))
    parser.add_argument("--timeout", type=float, default=600, help="seconds per step-time launch")
    parser.add_argument("--profile", action="store_true", help="profile one more step (rank 0, round 1)")
    parser.add_argument("--profile-rows", type=int, default=20)
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--enforce-cap", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    if parser.parse_known_args()[0].quick:  # other defaults; flags given still win
        parser.set_defaults(**_QUICK)
    return parser.parse_args()


_QUICK = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=176, vocab=1000, cap_gib=0.75, start=512)
_QUICK.update(granularity=512, max_len=4096, seq_len=512, rounds=1, steps=2)


def main() -> None:
    args = parse_args()
    if args.worker:
        args.keep_attention = args.variant == "shardwise-keep"
        args.variant = "shardwise" if args.keep_attention else args.variant
        return worker(args)
    started, load = datetime.now(timezone.utc), _LoadSampler()
    variants = args.variants.split(",")
    found, runs, order = {}, {}, []
    if args.skip != "capacity":
        for variant in variants:
            print(f"capacity: {variant}", file=sys.stderr, flush=True)
            found[variant] = search(args, variant)
    if args.skip != "time":
        runs, order = step_times(args, variants)
    params = next((r["params"] for rs in runs.values() for r in rs if "params" in r), _PARAMS.get("count"))
    lines = header(args, params, load, started)
    lines += capacity_report(args, found) + [""] if found else []
    lines += time_report(args, runs, order) if runs else []
    wall = (datetime.now(timezone.utc) - started).total_seconds()
    lines += ["", f"Wall time of the benchmark: {wall:.0f} s. Command: `{' '.join(sys.argv)}`"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
