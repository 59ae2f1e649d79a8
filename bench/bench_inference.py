"""Greedy decoding speed on CPU: plain Hugging Face ``generate`` against DeepSpeed's
``init_inference`` and shardwise's, in one run (issue 19).

A Llama built from ``transformers.LlamaConfig`` (no downloads; every process builds it from
``torch.manual_seed(0)``, so every row has the same weights) decodes random-token prompts
greedily, fp32, no end-of-sequence stop (``eos_token_id=None`` in the model's config and
generation config, and every row is checked to add exactly ``--new-tokens`` tokens)::

    python bench/bench_inference.py --profile --comm-stats --out bench/results/<date>-cpu-inference.md
    python bench/bench_inference.py --quick          # a smoke run (under 2 minutes)

Model configurations (``--configs``): ``large`` (hidden 512, 8 layers, 8 heads / 4 kv heads,
intermediate 1408, vocab 32000, 56.4M parameters: a decode step is bound by reading the
weights), ``small`` (hidden 256, 4 layers, 4 / 2 heads, intermediate 704, vocab 8000,
7.0M parameters: bound by per-step overhead) and ``moe`` (``small``'s attention in a
Mixtral: 8 experts of intermediate 512, top-2; ``bench_moe_inference.py`` times it).

Rows (``--rows``), each a fresh process (DeepSpeed's in its own interpreter,
``--peer-python``), warmed up with one generation per batch size before the timed runs:

- ``hf``: ``model.generate`` (the baseline; run first and again last, ``hf-again``, to show
  the noise).
- ``deepspeed``: ``deepspeed.init_inference(model, dtype=torch.float32,
  replace_with_kernel_inject=False)``, then ``engine.generate``.
- ``deepspeed-inject``: the same with ``replace_with_kernel_inject=True``.
- ``shardwise-inject``: ``shardwise.init_inference(..., replace_with_kernel_inject=True)``
  (the fast decoder).
- ``shardwise``: ``replace_with_kernel_inject=False`` (the model's own ``generate``).
- ``shardwise-inject-tp2``: ``tensor_parallel={"tp_size": 2}``, 2 processes
  (``torch.distributed.run``, gloo) with 1 thread each; rank 0's times. Its all-reduces and
  the logits' all-gather go through shardwise's same-host shared memory ([Note:
  shared-memory all-reduce] in ``shardwise/comm/_shm.py``), not through gloo.
- ``deepspeed-tp2``: DeepSpeed's AutoTP at ``tensor_parallel={"tp_size": 2}`` (no kernel
  inject), the same 2 x 1 layout: context for the shardwise tp2 row. Its block outputs are
  summed by its shared-memory all-reduce (``deepspeed_shm_comm_op``, JIT-built on first use),
  which needs ``LOCAL_SIZE`` (set by its ``deepspeed`` launcher, not by torchrun: without it
  the op segfaults), so the row sets ``LOCAL_SIZE=2``.
- ``shardwise-int8-inject``: ``dtype=torch.int8`` with kernel inject; also the int8 weight
  bytes (``engine.int8_report``) and the logit error against the fp32 model on a
  teacher-forced batch of random tokens.

Single-process rows use ``torch.set_num_threads(--threads)`` (2). Time to first token:
shardwise's ``engine.last_generation``; Hugging Face and DeepSpeed through a streamer that
notes the first new token. Total time: ``time.perf_counter`` around the ``generate`` call.
The machine may be shared: every timed run starts once the CPUs are idle and is repeated
(``--retries``) when other processes took more than ``--max-other`` of the CPUs during it
or, in one-process rows, some task waited for a CPU more than ``--max-stall`` of its time
(``/proc/pressure/cpu``); the table shows the worst values kept and the number of repeats.

``--profile`` adds a torch.profiler table per batch size for ``hf`` and
``shardwise-inject``; the ``shardwise-inject`` row always also breaks its decode step down
(``step_breakdown``): the step alone, its linear layers alone (the floor the step
approaches) and the step with the linear layers replaced by ready outputs.
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
from functools import partial
from pathlib import Path

from _machine import cpu_model, median_or_nan

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "large": dict(vocab=32000, hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408),
    "small": dict(vocab=8000, hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704),
    "moe": dict(vocab=8000, hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512, experts=8, top_k=2),
}
ROWS = [
    "hf",
    "deepspeed",
    "deepspeed-inject",
    "shardwise-inject",
    "shardwise",
    "shardwise-inject-tp2",
    "deepspeed-tp2",
    "shardwise-int8-inject",
    "hf-again",
]
GOAL = 0.7
"""Issue 19: at tp 1, total generation time <= 0.7x plain generate's and DeepSpeed's."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the model --------------------------------------------------------------------------------


def build_model(cfg: dict, max_positions: int):
    import torch
    import transformers

    torch.manual_seed(0)
    family = transformers.LlamaConfig
    if "experts" in cfg:  # Mixtral: every MLP a sparse MoE block
        family = partial(transformers.MixtralConfig, num_local_experts=cfg["experts"], num_experts_per_tok=cfg["top_k"])
    config = family(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # never stop early: every row adds exactly --new-tokens
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    return model.eval()


def prompts(cfg: dict, batch: int, length: int):
    import torch

    generator = torch.Generator().manual_seed(1000 + batch)
    return torch.randint(0, cfg["vocab"], (batch, length), generator=generator)


class FirstToken:
    """A ``generate`` streamer: notes when the first new token arrives (its first ``put``
    carries the prompt)."""

    def __init__(self, start: float) -> None:
        self.start, self.calls, self.first = start, 0, float("nan")

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter() - self.start

    def end(self) -> None:
        pass


# -- contention: the machine may be shared ----------------------------------------------------


def _machine_busy_seconds() -> float:
    """CPU seconds all processes (and the hypervisor, as steal) have used since boot."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _stalled_seconds() -> float:
    """Seconds (since boot) in which some runnable task waited for a CPU (Linux PSI,
    ``/proc/pressure/cpu``); nan where the kernel does not report it."""
    try:
        return int(Path("/proc/pressure/cpu").read_text().split("total=")[1].split()[0]) / 1e6
    except (OSError, IndexError, ValueError):
        return float("nan")


def wait_until_idle(threshold: float, timeout: float) -> float:
    """Waits (up to ``timeout`` s) for a half-second window in which the CPUs are busy less
    than ``threshold`` of the time (this process sleeps meanwhile, so that is other
    processes' load). Returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        busy = _machine_busy_seconds()
        time.sleep(0.5)
        if not (_machine_busy_seconds() - busy) / (0.5 * os.cpu_count()) >= threshold:  # nan: not measured
            return time.monotonic() - start
    return time.monotonic() - start


def _process_seconds(pids: list[int]) -> float:
    """CPU seconds the processes ``pids`` (all their threads) have used."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


class _Group:
    """The row's processes (1, or the 2 tensor-parallel ranks). Rank 0 decides (waits for
    idle CPUs, judges contention); the others follow."""

    def __init__(self, distributed: bool) -> None:
        self.distributed = distributed
        self.rank = 0
        self.pids = [os.getpid()]
        if distributed:
            import torch.distributed as dist

            self.rank = dist.get_rank()
            self.pids = [None] * dist.get_world_size()
            dist.all_gather_object(self.pids, os.getpid())

    def cpu_seconds(self) -> float:
        try:
            return _process_seconds(self.pids)
        except (OSError, IndexError, ValueError):
            return float("nan")

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def decide(self, value):
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def timed_generate(args, group: _Group, target, engine, ids, new_tokens: int) -> dict:
    """One generation, started when the CPUs are idle and repeated (``--retries``) while
    other processes took more than ``--max-other`` of the CPUs during it, or (one-process
    rows) some task waited for a CPU more than ``--max-stall`` of its time (Linux CPU
    pressure): with two compute threads on two cores, any other process makes every
    parallel op wait for it. The tensor-parallel rows are judged by the first test alone:
    their own two processes and gloo's threads already fill both cores."""
    for attempt in range(args.retries + 1):
        waited = wait_until_idle(args.idle_threshold, args.idle_timeout) if group.rank == 0 else 0.0
        group.barrier()
        busy, own, stalled = _machine_busy_seconds(), group.cpu_seconds(), _stalled_seconds()
        start = time.perf_counter()
        result = _generate(target, engine, ids, new_tokens)
        elapsed = time.perf_counter() - start
        stall = (_stalled_seconds() - stalled) / elapsed
        # /proc/stat counts 10 ms ticks: at least 0.5 s in the denominator
        other = max(
            (_machine_busy_seconds() - busy - (group.cpu_seconds() - own)) / (max(elapsed, 0.5) * os.cpu_count()), 0.0
        )
        contended = other > args.max_other or (not group.distributed and stall > args.max_stall)
        retry = group.decide(bool(contended) and attempt < args.retries)
        if not retry:
            return {**result, "stall": stall, "other": other, "attempts": attempt + 1, "waited_s": waited}
        if group.rank == 0:
            print(
                f"  [{args.config} {args.row}] batch {ids.shape[0]}: other processes {other:.0%} of the CPUs, "
                f"CPU stall {stall:.0%} of the run; repeating it",
                file=sys.stderr,
                flush=True,
            )
    raise AssertionError("unreachable")


# -- collectives (--comm-stats) -------------------------------------------------------------------


class _CommStats:
    """Counts torch.distributed's collectives and the time they block the caller (a
    synchronous call, or an async call's issue plus its ``wait``), while ``enabled``.
    Installed before either library is imported, so both call the wrappers."""

    def __init__(self) -> None:
        self.enabled, self.calls, self.seconds = False, 0, 0.0

    def install(self) -> None:
        import torch.distributed as dist

        stats = self

        class TimedWork:
            def __init__(self, work) -> None:
                self._work = work

            def wait(self, *a, **kw):
                start = time.perf_counter()
                try:
                    return self._work.wait(*a, **kw)
                finally:
                    if stats.enabled:
                        stats.seconds += time.perf_counter() - start

            def __getattr__(self, name):
                return getattr(self._work, name)

        def wrap(orig):
            def collective(*a, **kw):
                start = time.perf_counter()
                work = orig(*a, **kw)
                if stats.enabled:
                    stats.calls += 1
                    stats.seconds += time.perf_counter() - start
                return TimedWork(work) if kw.get("async_op") and work is not None else work

            return collective

        for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast"):
            if hasattr(dist, name):
                setattr(dist, name, wrap(getattr(dist, name)))


# -- worker: one row, every batch size --------------------------------------------------------


def _setup(args):
    """(what ``generate`` is called on, the shardwise engine or None, model info) of the
    worker's row."""
    import torch

    row = args.row.removesuffix("-again")
    cfg = CONFIGS[args.config]
    model = build_model(cfg, args.prompt_len + args.new_tokens + 8)
    info = {
        "params": sum(p.numel() for p in model.parameters()),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    if row == "hf":
        return model, None, info
    if row.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        extra = {"tensor_parallel": {"tp_size": 2}} if row.endswith("tp2") else {}
        engine = deepspeed.init_inference(
            model, dtype=torch.float32, replace_with_kernel_inject=row == "deepspeed-inject", **extra
        )
        return engine, None, info
    import shardwise

    kwargs = {
        "dtype": torch.int8 if "int8" in row else torch.float32,
        "replace_with_kernel_inject": "inject" in row,
        "max_out_tokens": args.prompt_len + args.new_tokens,
    }
    if row.endswith("tp2"):
        kwargs["tensor_parallel"] = {"tp_size": 2}
    reference = None
    if "int8" in row:
        seq = prompts(cfg, 4, args.prompt_len + args.new_tokens)
        with torch.inference_mode():
            reference = model(seq).logits.float()
    engine = shardwise.init_inference(model, **kwargs)
    info["fast_path"] = engine.fast_path
    if reference is not None:
        with torch.inference_mode():
            logits = engine(seq).logits.float()
        err = (logits - reference).abs()
        info["int8"] = {
            **engine.int8_report,
            "max_abs_err": err.max().item(),
            "mean_abs_err": err.mean().item(),
            "ref_max_abs": reference.abs().max().item(),
            "ref_std": reference.std().item(),
            "top1_match": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
            "positions": int(reference.shape[0] * reference.shape[1]),
        }
    return engine, engine, info


def _generate(target, shardwise_engine, ids, new_tokens: int) -> dict:
    import torch

    mask = torch.ones_like(ids)
    start = time.perf_counter()
    if shardwise_engine is not None:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
        total = time.perf_counter() - start
        ttft = shardwise_engine.last_generation.time_to_first_token_s
    else:
        clock = FirstToken(start)
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, streamer=clock)
        total = time.perf_counter() - start
        ttft = clock.first
    added = out.shape[1] - ids.shape[1]
    if added != new_tokens:
        raise RuntimeError(f"{added} new tokens, expected {new_tokens}")
    return {"total_s": total, "ttft_s": ttft, "tokens": out[:, ids.shape[1] :].tolist()}


def _median_time(fn, reps: int, warmup: int = 3) -> float:
    times = []
    for i in range(reps + warmup):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


class _ReadyOutput:
    """Stands in for a projection: returns a fixed tensor of its output's shape at once."""

    def __init__(self, out_features: int) -> None:
        self.out_features, self.outputs = out_features, {}

    def __call__(self, x):
        import torch

        key = tuple(x.shape[:-1])
        if key not in self.outputs:
            self.outputs[key] = torch.randn(*key, self.out_features) * 0.01
        return self.outputs[key]


def _fake_mlp(mlp, fake):
    """The gated MLP ``mlp`` with its projections replaced by ``fake`` ones."""
    import copy

    faked = copy.copy(mlp)
    faked.gate_up, faked.down = fake(mlp.gate_up), fake(mlp.down)
    return faked


def step_breakdown(decoder, cfg: dict, batch: int, prompt_len: int, reps: int = 50) -> dict | None:
    """Seconds of one decode step of shardwise's fast decoder (``decoder.forward``, timed
    apart from generate's loop, at a cache of ``prompt_len`` tokens: pass the middle of the
    generation), of its linear layers alone (the same weights and input
    shapes back to back: the floor the step approaches), and of the step with every linear
    layer replaced by a ready output (all the work around the matmuls). Reads the Llama
    decoder's internals; None if they have changed."""
    import torch
    import torch.nn.functional as F

    try:
        layers, head = decoder.layers, decoder.head
        weights = [p.weight for layer in layers for p in (layer[1], layer[2], layer[4].gate_up, layer[4].down)]
        weights.append(head.weight)
        inputs = {w.shape[1]: torch.randn(batch, 1, w.shape[1]) for w in weights}
        with torch.inference_mode():
            cache = decoder.new_cache(batch, prompt_len + 1)
            decoder.forward(
                prompts(cfg, batch, prompt_len), torch.arange(prompt_len).expand(batch, prompt_len), None, cache, 0
            )
            ids = prompts(cfg, batch, 1)
            positions = torch.full((batch, 1), prompt_len, dtype=torch.long)

            def step():
                decoder.forward(ids, positions, None, cache, prompt_len)

            def linears():
                for w in weights:
                    F.linear(inputs[w.shape[1]], w)

            step_s, floor_s = _median_time(step, reps), _median_time(linears, reps)
            fake = lambda proj: _ReadyOutput(proj.weight.shape[0])  # noqa: E731
            decoder.layers = [(a, fake(b), fake(c), d, _fake_mlp(e, fake), f) for a, b, c, d, e, f in layers]
            decoder.head = fake(head)
            try:
                no_linear_s = _median_time(step, reps)
            finally:
                decoder.layers, decoder.head = layers, head
    except (AttributeError, TypeError, ValueError) as exc:
        print(f"  step breakdown skipped: {exc!r}", file=sys.stderr, flush=True)
        return None
    return {"step_s": step_s, "floor_s": floor_s, "no_linear_s": no_linear_s}


def _profile(target, shardwise_engine, ids, new_tokens: int, rows: int) -> dict:
    """One generation under torch.profiler: the top ops, and the self CPU time per decode
    step of the matmuls, attention and everything else."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wall = _generate(target, shardwise_engine, ids, new_tokens)["total_s"]
    events = prof.key_averages()
    table = events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=50)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    attention = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key)
    total = sum(e.self_cpu_time_total for e in events)
    calls = sum(e.count for e in events if e.key.startswith("aten::"))
    return {
        "table": table,
        "wall_ms_per_step": 1000 * wall / new_tokens,
        "matmul_ms_per_step": matmul / 1000 / new_tokens,
        "attention_ms_per_step": attention / 1000 / new_tokens,
        "other_ms_per_step": (total - matmul - attention) / 1000 / new_tokens,
        "aten_calls_per_step": calls / new_tokens,
    }


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    tp2 = args.row.endswith("tp2")
    comm_stats = _CommStats() if args.comm_stats and tp2 else None
    if comm_stats is not None:
        comm_stats.install()
    target, engine, info = _setup(args)
    group = _Group(tp2)
    cfg = CONFIGS[args.config]
    result = {"info": info, "threads": torch.get_num_threads(), "batches": {}}
    for batch in args.batches:
        ids = prompts(cfg, batch, args.prompt_len)
        group.barrier()
        _generate(target, engine, ids, args.new_tokens)  # warm-up
        runs = [timed_generate(args, group, target, engine, ids, args.new_tokens) for _ in range(args.repeats)]
        entry = {"runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs], "tokens": runs[0]["tokens"]}
        if args.row == "shardwise-inject" and engine._decoder is not None:
            wait_until_idle(args.idle_threshold, args.idle_timeout)
            entry["breakdown"] = step_breakdown(engine._decoder, cfg, batch, args.prompt_len + args.new_tokens // 2)
        if comm_stats is not None:  # one more generation, counted
            group.barrier()
            comm_stats.enabled, comm_stats.calls, comm_stats.seconds = True, 0, 0.0
            out = _generate(target, engine, ids, args.new_tokens)
            comm_stats.enabled = False
            entry["comm"] = {"calls": comm_stats.calls, "seconds": comm_stats.seconds, "total_s": out["total_s"]}
        if args.profile and args.row in ("hf", "shardwise-inject"):
            wait_until_idle(args.idle_threshold, args.idle_timeout)
            entry["profile"] = _profile(target, engine, ids, min(args.new_tokens, 32), args.profile_rows)
        result["batches"][str(batch)] = entry
    if group.rank == 0:
        Path(args.result).write_text(json.dumps(result))
    if tp2:
        torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads sometimes abort it after a clean run


# -- driver -------------------------------------------------------------------------------------


def run_row(args, config: str, row: str) -> dict:
    deepspeed = row.startswith("deepspeed")
    python = args.peer_python if deepspeed else sys.executable
    if not Path(python).exists():
        return {"error": f"skipped: interpreter {python} not found (see bench/README.md)"}
    tp2 = row.endswith("tp2")
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        port = _free_port()
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1" if tp2 else str(args.threads),
            "DS_ACCELERATOR": "cpu",
            "SHARDWISE_ACCELERATOR": "cpu",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
        }
        if not tp2:  # a world of one for DeepSpeed's init_distributed (shardwise needs none at tp 1)
            env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        elif deepspeed:  # as DeepSpeed's launcher sets it: without it its CPU shared-memory all-reduce crashes
            env["LOCAL_SIZE"] = "2"
        worker_args = [
            __file__,
            "--worker",
            "--row",
            row,
            "--config",
            config,
            "--result",
            str(result),
            "--threads",
            "1" if tp2 else str(args.threads),
            "--batches",
            ",".join(map(str, args.batches)),
            "--new-tokens",
            str(args.new_tokens),
            "--prompt-len",
            str(args.prompt_len),
            "--repeats",
            str(args.repeats),
            "--profile-rows",
            str(args.profile_rows),
            "--max-stall",
            str(args.max_stall),
            "--max-other",
            str(args.max_other),
            "--retries",
            str(args.retries),
            *(["--comm-stats"] if args.comm_stats else []),
            "--idle-threshold",
            str(args.idle_threshold),
            "--idle-timeout",
            str(args.idle_timeout),
        ] + (["--profile"] if args.profile else [])
        if tp2:
            cmd = [
                python,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
            ] + worker_args
        else:
            cmd = [python] + worker_args
        started = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.timeout:.0f} s"}
        wall = time.perf_counter() - started
        if proc.returncode != 0 or not result.exists():
            lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
            errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
            return {"error": (errors[-1] if errors else lines[-1] if lines else f"exit {proc.returncode}")[:300]}
        out = json.loads(result.read_text())
    out.update(wall_s=wall)
    return out


def _versions(peer_python: str) -> dict:
    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if Path(peer_python).exists():
        out = subprocess.run(
            [
                peer_python,
                "-c",
                "import deepspeed, torch, transformers; "
                "print(deepspeed.__version__, torch.__version__, transformers.__version__)",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "DS_ACCELERATOR": "cpu"},
        )
        last = out.stdout.strip().splitlines()[-1].split() if out.returncode == 0 and out.stdout.strip() else None
        versions["deepspeed"] = (
            "{} (torch {}, transformers {} in {})".format(*last, peer_python)
            if last
            else f"unavailable ({peer_python} could not import it)"
        )
    else:
        versions["deepspeed"] = f"not installed ({peer_python} missing)"
    return versions


def _source_state() -> str:
    """The commit shardwise ran at, and whether its sources had uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "shardwise"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "shardwise (not a git checkout)"
    return f"shardwise at {head}" + (" with uncommitted changes in shardwise/" if dirty else "")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b == b and b > 0 else "-"  # b is nan when that row is missing


def _first_divergence(a: list[list[int]], b: list[list[int]]) -> str:
    """'all' when the token lists are equal, else the first step at which any row differs."""
    if a == b:
        return "all"
    steps = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra)) for ra, rb in zip(a, b)]
    return f"first {min(steps)}"


def report(args, results: dict[str, dict[str, dict]], wall: float) -> tuple[str, list[str]]:
    """The markdown tables and the goal lines."""
    lines, goals = [], []
    for config, rows in results.items():
        cfg = CONFIGS[config]
        params = next((r["info"]["params"] for r in rows.values() if "info" in r), 0)
        lines += [
            f"### {config}: hidden {cfg['hidden']}, {cfg['layers']} layers, {cfg['heads']} heads / "
            f"{cfg['kv_heads']} kv heads, intermediate {cfg['intermediate']}, vocab {cfg['vocab']} "
            f"({params / 1e6:.1f}M parameters, {4 * params / 2**20:.0f} MiB fp32)",
            "",
        ]
        for batch in map(str, args.batches):
            base = rows.get("hf", {}).get("batches", {}).get(batch)
            base_t = median_or_nan([r["total_s"] for r in base["runs"]]) if base else float("nan")
            ds = rows.get("deepspeed", {}).get("batches", {}).get(batch)
            ds_t = median_or_nan([r["total_s"] for r in ds["runs"]]) if ds else float("nan")
            lines += [
                f"Batch {batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, median of "
                f"{args.repeats} timed runs after 1 warm-up:",
                "",
                "| row | processes x threads | time to first token ms | tokens/s | ms per decode step | "
                "total s (min-max) | vs hf | vs deepspeed | tokens equal to hf's | other CPU / stall (repeated runs) |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            ]
            for row, out in rows.items():
                if "error" in out:
                    lines.append(f"| {row} | | error: {out['error']} | | | | | | | |")
                    continue
                entry = out["batches"][batch]
                totals = [r["total_s"] for r in entry["runs"]]
                total, ttft = median_or_nan(totals), median_or_nan([r["ttft_s"] for r in entry["runs"]])
                step = (total - ttft) / (args.new_tokens - 1) if args.new_tokens > 1 else float("nan")
                procs = "2 x 1" if row.endswith("tp2") else f"1 x {out['threads']}"
                same = _first_divergence(entry["tokens"], base["tokens"]) if base else "-"
                if same.startswith("first"):
                    same += " steps"
                lines.append(
                    f"| {row} | {procs} | {1000 * ttft:.1f} | {int(batch) * args.new_tokens / total:.1f} | "
                    f"{1000 * step:.2f} | {total:.3f} ({min(totals):.3f}-{max(totals):.3f}) "
                    f"| {_ratio(total, base_t)} | "
                    f"{_ratio(total, ds_t)} | {same} | {max(r['other'] for r in entry['runs']):.0%} / "
                    f"{max(r['stall'] for r in entry['runs']):.0%} "
                    f"({sum(r['attempts'] - 1 for r in entry['runs'])}) |"
                )
            lines.append("")
            sw = rows.get("shardwise-inject", {}).get("batches", {}).get(batch)
            if sw:
                t = median_or_nan([r["total_s"] for r in sw["runs"]])
                verdict = lambda r: ("met" if r <= GOAL else "NOT met") + f" ({r:.2f}x)"  # noqa: E731
                again = rows.get("hf-again", {}).get("batches", {}).get(batch)
                again_note = ""
                if again:  # the baseline's second run, after every other row: how far the machine drifted
                    again_t = median_or_nan([r["total_s"] for r in again["runs"]])
                    again_note = f" ({t / again_t:.2f}x against the hf-again run)"
                goal = (
                    f"{config}, batch {batch}: shardwise-inject tp 1 vs plain generate "
                    f"{verdict(t / base_t) if base else 'no baseline'}{again_note}; vs DeepSpeed "
                    f"{verdict(t / ds_t) if ds else 'no DeepSpeed row'}"
                )
                goals.append(goal)
                if sw.get("breakdown"):
                    ttft = median_or_nan([r["ttft_s"] for r in sw["runs"]])
                    step = (t - ttft) / max(args.new_tokens - 1, 1)
                    bd = {k: 1000 * v for k, v in sw["breakdown"].items()}
                    inside = bd["step_s"] - bd["no_linear_s"]
                    lines += [
                        f"shardwise-inject, where a decode step goes (ms, medians of 50, timed apart after the "
                        f"runs, the cache at {args.prompt_len + args.new_tokens // 2} tokens): in generate "
                        f"{1000 * step:.2f} (mean); `decoder.forward` alone {bd['step_s']:.2f}, "
                        f"so generate's loop adds {1000 * step - bd['step_s']:.2f}; its "
                        f"{4 * CONFIGS[config]['layers'] + 1} linear layers alone (same weights and input "
                        f"shapes, back to back) {bd['floor_s']:.2f}; the step with every linear layer replaced "
                        f"by a ready output (the work around the matmuls) {bd['no_linear_s']:.2f}; so the "
                        f"linear layers take {inside:.2f} inside the step, {inside - bd['floor_s']:+.2f} "
                        f"against alone.",
                        "",
                    ]
        for row, out in rows.items():
            for batch in map(str, args.batches):
                comm = out.get("batches", {}).get(batch, {}).get("comm")
                if comm:
                    lines += [
                        f"{row}, batch {batch}, collectives through torch.distributed (one more generation, rank "
                        f"0): {comm['calls'] / args.new_tokens:.1f} per generated token, blocking "
                        f"{1000 * comm['seconds'] / args.new_tokens:.2f} ms of its "
                        f"{1000 * comm['total_s'] / args.new_tokens:.2f} ms"
                        + (
                            " (DeepSpeed's shared-memory all-reduce does not go through torch.distributed and "
                            "is not counted)"
                            if row.startswith("deepspeed")
                            else " (the tensor group's shared-memory all-reduces and all-gathers do not go through "
                            "torch.distributed and are not counted)"
                        )
                        + ".",
                        "",
                    ]
        int8 = rows.get("shardwise-int8-inject", {}).get("info", {}).get("int8")
        if int8:
            lines += [
                f"int8 (shardwise-int8-inject): {int8['layers']} linear layers (LM head kept fp32), weights "
                f"{int8['bytes_before'] / 2**20:.1f} MiB -> {int8['bytes_after'] / 2**20:.1f} MiB (saved "
                f"{(int8['bytes_before'] - int8['bytes_after']) / 2**20:.1f} MiB, "
                f"{(int8['bytes_before'] - int8['bytes_after']) / (4 * params):.0%} of the fp32 model). "
                f"Logits vs fp32 over {int8['positions']} teacher-forced positions (4 rows of random "
                f"tokens): max abs error {int8['max_abs_err']:.4f}, mean {int8['mean_abs_err']:.5f} (fp32 "
                f"logits: max abs {int8['ref_max_abs']:.3f}, std {int8['ref_std']:.3f}); top-1 token equal "
                f"at {int8['top1_match']:.1%} of positions.",
                "",
            ]
        for row in ("hf", "shardwise-inject"):
            for batch in map(str, args.batches):
                prof = rows.get(row, {}).get("batches", {}).get(batch, {}).get("profile")
                if prof:
                    lines += [
                        f"Profile of {row}, batch {batch}, {min(args.new_tokens, 32)} new tokens "
                        f"(self CPU time per generated token, under the profiler): wall "
                        f"{prof['wall_ms_per_step']:.2f} ms, matmuls (mm/addmm/bmm) "
                        f"{prof['matmul_ms_per_step']:.2f} ms, attention {prof['attention_ms_per_step']:.2f} ms, "
                        f"everything else {prof['other_ms_per_step']:.2f} ms; "
                        f"{prof['aten_calls_per_step']:.0f} aten calls per token",
                        "",
                        "```",
                        prof["table"].rstrip(),
                        "```",
                        "",
                    ]
    return "\n".join(lines), goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="large,small", help=f"of {sorted(CONFIGS)}")
    parser.add_argument(
        "--rows",
        default=",".join(ROWS),
        help="rows in the order run; a row named <row>-again runs <row> again (the noise)",
    )
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch size (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of single-process rows")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 new tokens, 1 timed run")
    parser.add_argument(
        "--peer-python",
        default=os.environ.get("DS_PYTHON", "/work/ds-env/bin/python"),
        help="interpreter with deepspeed (and transformers) installed",
    )
    parser.add_argument("--profile", action="store_true", help="torch.profiler tables of hf and shardwise-inject")
    parser.add_argument("--profile-rows", type=int, default=15)
    parser.add_argument(
        "--comm-stats",
        action="store_true",
        help="tp2 rows: count the collectives of one more generation and the time they block rank 0",
    )
    parser.add_argument(
        "--max-stall",
        type=float,
        default=0.05,
        help="repeat a timed run in which tasks waited for a CPU more than this share of its time",
    )
    parser.add_argument(
        "--max-other",
        type=float,
        default=0.05,
        help="repeat a timed run in which other processes used more than this share of the CPUs",
    )
    parser.add_argument("--retries", type=int, default=4, help="repeats of a contended run before it is kept")
    parser.add_argument(
        "--idle-threshold",
        type=float,
        default=0.05,
        help="a timed run starts when other processes use less than this share of the CPUs",
    )
    parser.add_argument("--idle-timeout", type=float, default=60, help="seconds to wait for idle CPUs per run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per row process")
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.worker:
        return worker(args)
    if args.quick:
        args.new_tokens, args.repeats = 16, 1
    started = time.perf_counter()
    source = _source_state()
    results: dict[str, dict[str, dict]] = {}
    for config in args.configs.split(","):
        results[config] = {}
        for row in args.rows.split(","):
            print(f"{config}: {row} ...", file=sys.stderr, flush=True)
            out = run_row(args, config, row)
            results[config][row] = out
            if "error" in out:
                print(f"  {out['error']}", file=sys.stderr, flush=True)
            else:
                print(
                    "  "
                    + "; ".join(
                        f"batch {b}: {median_or_nan([r['total_s'] for r in e['runs']]):.3f} s"
                        for b, e in out["batches"].items()
                    )
                    + f" (process {out['wall_s']:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    wall = time.perf_counter() - started
    versions = _versions(args.peer_python)
    tables, goals = report(args, results, wall)
    command = "python bench/bench_inference.py " + " ".join(sys.argv[1:])
    text = "\n".join(
        [
            "# Greedy decoding on CPU: plain generate, DeepSpeed init_inference, shardwise init_inference",
            "",
            f"{date.today()} | {cpu_model()} ({os.cpu_count()} cores) | torch {versions['torch']}, transformers "
            f"{versions['transformers']} | deepspeed {versions['deepspeed']} | {source} | fp32",
            "",
            f"Command: `{command}`",
            "",
            f"Random-token prompts of {args.prompt_len}, greedy, {args.new_tokens} new tokens forced (no eos), "
            f"`torch.manual_seed(0)` weights; each row a fresh process; 1 warm-up generation per batch size, then "
            f"{args.repeats} timed. tokens/s = batch x new tokens / total time; ms per decode step = (total - time to "
            f"first token) / (new tokens - 1). Single-process rows: `torch.set_num_threads({args.threads})`; tp2 rows: "
            f'2 processes (`torch.distributed.run`, gloo) x 1 thread. "tokens equal to hf\'s": the greedy tokens of '
            f"every sequence equal the hf row's, or the first step at which any sequence differs. \"other CPU / "
            f'stall": the largest share of the CPUs other processes used during a kept run, and of its time in '
            f"which some task waited for a CPU (`/proc/pressure/cpu`; the tp2 rows' own processes cause theirs); "
            f"runs over {args.max_other:.0%} / {args.max_stall:.0%} were repeated (count in parentheses) after "
            f"waiting for idle CPUs.",
            "",
            tables,
            "## Goal (issue 19): total generation time at tp 1 <= 0.7x plain generate and <= 0.7x DeepSpeed",
            "",
            *[f"- {g}" for g in goals],
            "",
            f"wall time of the benchmark: {wall:.0f} s",
            "",
        ]
    )
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
