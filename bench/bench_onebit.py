"""Bytes on the wire, loss and step time of the 1-bit optimizers against their uncompressed
counterparts: 1-bit Adam and 0/1 Adam against Adam, 1-bit LAMB against LAMB.

A GPT-style decoder (``examples/gpt_model.py``, untied head; default vocab 8192, width 512,
6 layers, 8 heads, about 27.4M parameters, sequence 128, micro-batch 2 per rank) trains on
byte tokens of the Python standard library's sources (``byte_corpus``; every optimizer of a
world size sees the same global batches, the same initial weights, seed 0) at ZeRO stage 0,
fp32, gradient clipping 1.0, on 2 and 4 ranks (CPU, gloo, one thread per rank; every rank a
process of its own)::

    python bench/bench_onebit.py --out bench/results/<date>-cpu-onebit.md
    # a quick smoke run
    python bench/bench_onebit.py --width 128 --layers 2 --heads 4 --vocab 1024 --steps 8 --freeze-step 3 \
        --world-sizes 2 --throttle-steps 6

Optimizers (``--optimizers``; those whose module shardwise does not have yet are skipped with a
note): ``adam`` (config type ``Adam``: torch's fused AdamW, weight decay 0), ``onebitadam``
(``freeze_step``), ``zerooneadam`` (``var_freeze_step``; ``--zoadam-params`` adds its other
keys), ``lamb`` (``Lamb``) and ``onebitlamb`` (``freeze_step``). The warm-up is ``--freeze-step``
steps; everything below is measured over steps ``freeze_step + 2 .. steps`` (1-based; the first
compressed step is left out).

Bytes per step and rank, three ways:

1. the engine's communicator counters (``engine.comm.bytes``: payload bytes per collective kind;
   all-reduce counts the tensor, all-to-all its input, all-gather its output), and from them the
   bytes each rank sends with gloo's algorithms: ring all-reduce ``2 (N-1)/N`` of the payload,
   all-to-all and ring all-gather ``(N-1)/N`` (the "expected" column);
2. at the OS: the ``wchar`` delta of ``/proc/self/io`` of each rank process (gloo's TCP pairs send
   with ``writev``, which the kernel counts there; the report checks it against (1));
3. interface counters: ``tx_bytes`` of ``/proc/net/dev`` (loopback runs: ``lo`` read by rank 0,
   which counts every process on the machine, all ranks included; throttled runs: each rank's own
   veth, exact for that rank, TCP/IP headers included).

Step time: median seconds per step on rank 0 over the measured steps; the time the rank blocks
in the communicator's waits (``Handle.wait``) is subtracted to give a compute time, and the
modelled step at ``--bandwidths`` is compute + bytes sent per rank / bandwidth (no overlap; for
the uncompressed optimizers also the perfect-overlap bound max(compute, communication)). With
``--throttle RATE`` (root, ``ip`` and ``tc``) every rank also runs in a network namespace of its
own, its veth on a bridge with a ``tc`` token-bucket filter (``tbf``) of RATE in both
directions, and the measured step time there is reported beside the model. Nothing touches the
loopback interface of the machine; the namespaces are deleted on exit.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import platform
import shutil
import signal
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

OPTIMIZERS = {
    # name: (config type, shardwise module that must exist, uncompressed counterpart, goal: bytes ratio)
    "adam": ("Adam", None, None, None),
    "onebitadam": ("OneBitAdam", "shardwise.optim.onebit.adam", "adam", 5.0),
    "zerooneadam": ("ZeroOneAdam", "shardwise.optim.onebit.zoadam", "adam", 10.0),
    "lamb": ("Lamb", None, None, None),
    "onebitlamb": ("OneBitLamb", "shardwise.optim.onebit.lamb", "lamb", 4.0),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _available(name: str) -> bool:
    module = OPTIMIZERS[name][1]
    if module is None:
        return True
    sys.path.insert(0, str(REPO))
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False
    finally:
        sys.path.remove(str(REPO))


def _optimizer_config(args, name: str) -> dict:
    kind = OPTIMIZERS[name][0]
    lamb = name in ("lamb", "onebitlamb")
    params = {"lr": args.lamb_lr if lamb else args.lr, "weight_decay": 0.0}
    if name in ("onebitadam", "onebitlamb"):
        params["freeze_step"] = args.freeze_step
    if name == "zerooneadam":
        params["var_freeze_step"] = args.freeze_step
        params.update(json.loads(args.zoadam_params))
    return {"type": kind, "params": params}


# -- OS counters ----------------------------------------------------------------------------------


def _proc_io() -> dict:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = int(value)
    return out


def _tx_bytes(interface: str) -> int:
    """Bytes sent on ``interface`` as this process's network namespace counts them."""
    for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        if name.strip() == interface:
            return int(rest.split()[8])
    return -1


# -- worker: one rank ---------------------------------------------------------------------------


def worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO / "examples"))
    from gpt_model import GPT, GPTConfig, byte_corpus

    import shardwise
    from shardwise.comm import _collectives

    blocked = [0.0]
    original_wait = _collectives.Handle.wait

    def timed_wait(self):
        start = time.perf_counter()
        try:
            return original_wait(self)
        finally:
            blocked[0] += time.perf_counter() - start

    _collectives.Handle.wait = timed_wait  # time this rank spends waiting for collectives
    if args.exact_exchange:
        from shardwise.optim.onebit import CompressedOptimizer

        def exact_average_(self, tensors, *, tag, params=None, state=False):
            comm = self.communicator()
            flat = torch.cat([t.reshape(-1).float() for t in tensors])
            comm.all_reduce(flat, tag=f"exact {tag}").wait()
            flat.div_(comm.world_size)
            torch._foreach_copy_(
                tensors, [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
            )

        CompressedOptimizer.compressed_average_ = exact_average_

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = GPTConfig(
        vocab_size=args.vocab,
        width=args.width,
        num_layers=args.layers,
        num_heads=args.heads,
        seq_len=args.seq_len,
        tie_weights=False,
    )
    torch.manual_seed(0)
    model = GPT(config)
    params = sum(p.numel() for p in model.parameters())
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
        "optimizer": _optimizer_config(args, args.optimizer),
    }
    engine, optimizer, _, _ = shardwise.initialize(model=model, config=ds_config)
    # the same global batches for every optimizer: step s, rank r reads rows r*mb .. (r+1)*mb of batch s
    rows = world * args.micro_batch
    corpus = byte_corpus(max_bytes=max(args.steps * rows * (args.seq_len + 1) + 1, 4096))
    windows = corpus[: args.steps * rows * (args.seq_len + 1)].long().view(args.steps, rows, args.seq_len + 1)
    start_measure = args.freeze_step + 1  # 0-based: warm-up 0..F-1, first compressed step F left out
    times, phases, losses, waits = [], [], [], []
    before = after = None

    def snapshot():
        return {
            "bytes": dict(engine.comm.bytes),
            "calls": dict(engine.comm.calls),
            "io": _proc_io(),
            "tx": _tx_bytes(args.interface),
            "t": time.perf_counter(),
        }

    for step in range(args.steps):
        if step == start_measure:
            before = snapshot()
        batch = windows[step, rank * args.micro_batch : (rank + 1) * args.micro_batch]
        x, y = batch[:, :-1], batch[:, 1:]
        wait0 = blocked[0]
        t0 = time.perf_counter()
        loss = engine(x, y)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        times.append(t3 - t0)
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        waits.append(blocked[0] - wait0)
        losses.append(loss.item())
    after = snapshot()
    measured = args.steps - start_measure
    delta = {
        "steps": measured,
        "bytes": {
            k: (v - before["bytes"].get(k, 0)) / measured
            for k, v in after["bytes"].items()
            if v - before["bytes"].get(k, 0)
        },
        "calls": {
            k: (v - before["calls"].get(k, 0)) / measured
            for k, v in after["calls"].items()
            if v - before["calls"].get(k, 0)
        },
        "io": {k: (after["io"][k] - before["io"][k]) / measured for k in after["io"]},
        "tx": (after["tx"] - before["tx"]) / measured if before["tx"] >= 0 else None,
        "wall": (after["t"] - before["t"]) / measured,
    }
    result = {
        "times": times,
        "phases": phases,
        "losses": losses,
        "waits": waits,
        "delta": delta,
        "params": params,
        "optimizer_class": type(optimizer).__name__,
        "start_measure": start_measure,
    }
    Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
    engine.comm.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads sometimes abort it after a clean run


# -- network namespaces with a token-bucket link (--throttle) ------------------------------------


class ThrottledNet:
    """``world`` network namespaces, one per rank, each with a veth whose other end sits on a
    bridge in a hub namespace; a tbf qdisc of ``rate`` on both ends of every veth limits each
    rank's sending and receiving, like one NIC per rank on a switch. Deleted on exit."""

    def __init__(self, world: int, rate: str, burst: str):
        self.world, self.rate, self.burst = world, rate, burst
        self.prefix = f"swb{os.getpid() % 100000}"
        self.hub = f"{self.prefix}hub"
        self.namespaces: list[str] = []

    @staticmethod
    def _ip(*cmd: str) -> None:
        subprocess.run(list(cmd), check=True, capture_output=True, text=True)

    def ns(self, rank: int) -> str:
        return f"{self.prefix}n{rank}"

    def interface(self, rank: int) -> str:
        return f"{self.prefix}r{rank}"

    def address(self, rank: int) -> str:
        return f"10.77.0.{rank + 1}"

    def __enter__(self):
        atexit.register(self.close)
        try:
            self._ip("ip", "netns", "add", self.hub)
            self.namespaces.append(self.hub)
            self._ip("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            self._ip("ip", "-n", self.hub, "link", "set", "br0", "up")
            for rank in range(self.world):
                ns, inner, outer = self.ns(rank), self.interface(rank), f"{self.prefix}h{rank}"
                self._ip("ip", "netns", "add", ns)
                self.namespaces.append(ns)
                self._ip("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
                self._ip("ip", "link", "set", inner, "netns", ns)
                self._ip("ip", "link", "set", outer, "netns", self.hub)
                self._ip("ip", "-n", self.hub, "link", "set", outer, "master", "br0")
                self._ip("ip", "-n", self.hub, "link", "set", outer, "up")
                self._ip("ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", inner)
                self._ip("ip", "-n", ns, "link", "set", inner, "up")
                self._ip("ip", "-n", ns, "link", "set", "lo", "up")
                for space, dev in ((ns, inner), (self.hub, outer)):
                    self._ip(
                        "ip",
                        "netns",
                        "exec",
                        space,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        self.rate,
                        "burst",
                        self.burst,
                        "latency",
                        "50ms",
                    )
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        while self.namespaces:
            subprocess.run(["ip", "netns", "del", self.namespaces.pop()], capture_output=True)

    def __exit__(self, *exc):
        self.close()


def throttle_possible() -> str | None:
    """None when namespaces with tc can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}`"
    try:
        with ThrottledNet(1, "1gbit", "256kb"):
            pass
    except subprocess.CalledProcessError as exc:
        return f"`{' '.join(exc.cmd)}` failed: {exc.stderr.strip()}"
    return None


# -- driver ---------------------------------------------------------------------------------------


def _code_state() -> str:
    """HEAD and a digest of uncommitted changes under shardwise/ (the library may change between
    runs when others work in the same tree)."""
    import hashlib

    def git(*cmd):
        return subprocess.run(["git", "-C", str(REPO), *cmd], capture_output=True, text=True).stdout

    diff = git("diff", "HEAD", "--", "shardwise")
    return git("rev-parse", "--short", "HEAD").strip() + (
        f"+{hashlib.sha1(diff.encode()).hexdigest()[:8]}" if diff else ""
    )


def _worker_args(args) -> list[str]:
    return [
        "--vocab",
        str(args.vocab),
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--seq-len",
        str(args.seq_len),
        "--micro-batch",
        str(args.micro_batch),
        "--freeze-step",
        str(args.freeze_step),
        "--lr",
        str(args.lr),
        "--lamb-lr",
        str(args.lamb_lr),
        "--clip",
        str(args.clip),
        "--zoadam-params",
        args.zoadam_params,
    ] + (["--exact-exchange"] if args.exact_exchange else [])


def run(args, optimizer: str, world: int, *, steps: int, net: ThrottledNet | None = None) -> dict:
    port = _free_port()
    code = _code_state()
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result"
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": net.address(0) if net else "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "SHARDWISE_ACCELERATOR": "cpu",
                # the ranks stand for separate hosts: no same-host shared memory (comm/_shm.py)
                "SHARDWISE_SHM_ALLREDUCE": "0",
                "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
            }
            interface = "lo"
            prefix: list[str] = []
            if net:
                interface = net.interface(rank)
                env["GLOO_SOCKET_IFNAME"] = interface
                prefix = ["ip", "netns", "exec", net.ns(rank)]
            cmd = (
                prefix
                + [
                    sys.executable,
                    __file__,
                    "--worker",
                    "--optimizer",
                    optimizer,
                    "--steps",
                    str(steps),
                    "--result",
                    str(result),
                    "--interface",
                    interface,
                ]
                + _worker_args(args)
            )
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        started = time.perf_counter()
        try:
            outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return {"error": f"timed out after {args.timeout} s"}
        wall = time.perf_counter() - started
        if any(p.returncode for p in procs):
            failed = next(o for p, o in zip(procs, outputs) if p.returncode)
            lines = [ln for ln in failed.strip().splitlines() if ln.strip()]
            error = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "failed")
            return {"error": error[:240], "code": code}
        ranks = [json.loads(result.with_suffix(f".rank{r}.json").read_text()) for r in range(world)]
    first = ranks[0]["start_measure"]
    times = ranks[0]["times"][first:]
    waits = ranks[0]["waits"][first:]
    return {
        "world": world,
        "steps": steps,
        "wall_s": wall,
        "code": code,
        "params": ranks[0]["params"],
        "class": ranks[0]["optimizer_class"],
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
        "wait": statistics.median(waits),
        "compute": statistics.median(t - w for t, w in zip(times, waits)),
        "phases": [statistics.median(p[k] for p in ranks[0]["phases"][first:]) for k in range(3)],
        "losses": [statistics.fmean(v) for v in zip(*(r["losses"] for r in ranks))],
        "delta": [r["delta"] for r in ranks],
    }


def expected_sent(delta: dict, world: int) -> float:
    """Bytes one rank sends per step under gloo's algorithms, from the payload counters."""
    factor = {
        "all_reduce": 2 * (world - 1) / world,
        "all_to_all": (world - 1) / world,
        "all_gather": (world - 1) / world,
        "reduce_scatter": (world - 1) / world,
        "broadcast": 1.0,
    }  # broadcast: an upper bound (only the root sends it all)
    return sum(factor.get(op, 1.0) * b for op, b in delta["bytes"].items())


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else float("nan")


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def _rate_bits(text: str) -> float:
    text = text.lower().strip()
    for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * mult
    return float(text)


def summarise(runs: dict, throttled: dict, args) -> dict:
    """Per (world, optimizer): bytes three ways, modelled and measured step times."""
    out = {}
    for (world, name), r in runs.items():
        if "error" in r:
            continue
        deltas = r["delta"]
        payload = _mean([sum(d["bytes"].values()) for d in deltas])
        expected = _mean([expected_sent(d, world) for d in deltas])
        wchar = _mean([d["io"]["wchar"] for d in deltas])
        tx_lo = deltas[0]["tx"]  # rank 0's view of lo: all ranks (and anything else on the machine)
        comm_model = {bw: expected * 8 / _rate_bits(bw) for bw in args.bandwidths.split(",")}
        model = {bw: r["compute"] + c for bw, c in comm_model.items()}
        overlap = {bw: max(r["compute"], c) for bw, c in comm_model.items()}
        t = throttled.get((world, name), {})
        out[(world, name)] = {
            "payload": payload,
            "expected": expected,
            "wchar": wchar,
            "lo_all": tx_lo,
            "model": model,
            "overlap": overlap,
            "run": r,
            "throttled": t,
            "veth": _mean([d["tx"] for d in t["delta"]]) if "delta" in t else None,
        }
    return out


def report(args, runs: dict, throttled: dict, skipped: list[str], throttle_note: str | None, versions: str) -> str:
    s = summarise(runs, throttled, args)
    bws = args.bandwidths.split(",")
    any_run = next(iter(r for r in runs.values() if "error" not in r), None)
    lines = [
        "# 1-bit optimizers: bytes on the wire, loss and step time",
        "",
        f"{date.today()} | {cpu_model()} ({os.cpu_count()} cores) | {versions} | gloo, fp32, ZeRO stage 0",
        "",
        f"GPT (examples/gpt_model.py, untied head): vocab {args.vocab}, width {args.width}, {args.layers} layers, "
        f"{args.heads} heads, sequence {args.seq_len}"
        + (f", {any_run['params']:,} parameters" if any_run else "")
        + f"; byte tokens of the stdlib sources, micro-batch {args.micro_batch} per rank; clipping {args.clip}; "
        f"Adam family lr {args.lr}, LAMB family lr {args.lamb_lr}, weight decay 0; warm-up (freeze_step / "
        f"var_freeze_step) {args.freeze_step}; {args.steps} steps; measured steps "
        f"{args.freeze_step + 2}..{args.steps} (1-based); 1 thread per rank.",
        "",
    ]
    if skipped:
        lines += [f"Skipped (not in shardwise yet): {', '.join(skipped)}.", ""]
    if args.zoadam_params != "{}":
        lines += [f"ZeroOneAdam extra params: `{args.zoadam_params}`", ""]
    # -- the headline table
    lines += [
        "## Summary: ratios against the uncompressed counterpart",
        "",
        "Bytes: per rank and step after the warm-up. 'counter' = the communicator's payload bytes, "
        "'sent (counter)' = the bytes gloo's algorithms send for that payload, 'wchar' = /proc/self/io "
        "of the rank processes (OS), 'veth' = the rank's interface tx bytes in the throttled run (OS, "
        "headers included). Step time at " + ", ".join(bws) + ": model = compute + sent / bandwidth "
        "(no overlap); 'tbf' = measured with the link throttled by tc"
        + (f" ({args.throttle})" if args.throttle else "")
        + ".",
        "",
        "| ranks | optimizer | vs | counter x | sent (counter) x | wchar x | veth x | goal (bytes) | "
        + " | ".join(f"step x model {bw}" for bw in bws)
        + " | step x model 1gbit vs overlapped | step x tbf |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |" + " --- |" * len(bws) + " --- | --- |",
    ]
    for (world, name), row in s.items():
        base_name = OPTIMIZERS[name][2]
        if base_name is None or (world, base_name) not in s:
            continue
        base = s[(world, base_name)]
        goal = OPTIMIZERS[name][3]
        ratio = lambda a, b: f"{a / b:.1f}" if a and b and a == a and b == b else "-"  # noqa: E731
        wx = base["wchar"] / row["wchar"] if row["wchar"] else float("nan")
        goal_cell = f">= {goal:g}x: {'met' if wx >= goal else 'NOT met'} (wchar)"
        t_base, t_row = base["throttled"].get("median"), row["throttled"].get("median")
        first_bw = bws[0]
        lines.append(
            f"| {world} | {name} | {base_name} | {ratio(base['payload'], row['payload'])} | "
            f"{ratio(base['expected'], row['expected'])} | {ratio(base['wchar'], row['wchar'])} | "
            f"{ratio(base['veth'], row['veth'])} | {goal_cell} | "
            + " | ".join(f"{base['model'][bw] / row['model'][bw]:.2f}" for bw in bws)
            + f" | {base['overlap'][first_bw] / row['model'][first_bw]:.2f} | "
            + (f"{t_base / t_row:.2f}" if t_base and t_row else "-")
            + " |"
        )
    # -- bytes
    lines += [
        "",
        "## Bytes per rank and step (MiB), after the warm-up",
        "",
        "| ranks | optimizer | class | collectives per step (calls: payload MiB) | counter MiB | sent (counter) MiB "
        "| wchar MiB (ranks' mean) | wchar / sent | lo tx MiB (all ranks + machine) | veth tx MiB (tbf run) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (world, name), r in runs.items():
        if "error" in r:
            lines.append(f"| {world} | {name} | error: {r['error']} | | | | | | | |")
            continue
        row, d = s[(world, name)], r["delta"][0]
        ops = ", ".join(f"{op} {d['calls'].get(op, 0):.2f}: {_mib(b)}" for op, b in sorted(d["bytes"].items()))
        check = f"{row['wchar'] / row['expected']:.3f}" if row["expected"] else "-"
        lines.append(
            f"| {world} | {name} | {r['class']} | {ops or 'none'} | {_mib(row['payload'])} | "
            f"{_mib(row['expected'])} | {_mib(row['wchar'])} | {check} | "
            f"{_mib(row['lo_all']) if row['lo_all'] is not None else '-'} | "
            f"{_mib(row['veth']) if row['veth'] is not None else '-'} |"
        )
    # -- step time
    lines += [
        "",
        "## Step time (seconds, rank 0, median over the measured steps)",
        "",
        "'loopback' = the unthrottled run; 'blocked' = time in the communicator's waits; compute = step - "
        "blocked (per step, median); model = compute + sent (counter) / bandwidth; overlapped = "
        "max(compute, sent / bandwidth), the bound for an uncompressed optimizer whose all-reduce hides "
        "entirely behind backward; tbf = measured in namespaces with the link throttled.",
        "",
        "| ranks | optimizer | loopback step | min-max | fwd / bwd / step phase | blocked | compute | "
        + " | ".join(f"model {bw} | overlapped {bw}" for bw in bws)
        + " | tbf step | tbf min-max | tbf blocked |",
        "| --- | --- | --- | --- | --- | --- | --- |" + " --- | --- |" * len(bws) + " --- | --- | --- |",
    ]
    for (world, name), r in runs.items():
        if "error" in r:
            continue
        row, t = s[(world, name)], throttled.get((world, name), {})
        f, b, st = r["phases"]
        tcell = (
            f"{t['median']:.3f} | {t['min']:.3f}-{t['max']:.3f} | {t['wait']:.3f}"
            if "median" in t
            else (f"error: {t['error']} | | " if "error" in t else "- | - | -")
        )
        lines.append(
            f"| {world} | {name} | {r['median']:.3f} | {r['min']:.3f}-{r['max']:.3f} | "
            f"{f:.3f} / {b:.3f} / {st:.3f} | {r['wait']:.3f} | {r['compute']:.3f} | "
            + " | ".join(f"{row['model'][bw]:.3f} | {row['overlap'][bw]:.3f}" for bw in bws)
            + f" | {tcell} |"
        )
    # -- losses
    for world in sorted({w for w, _ in runs}):
        names = [n for (w, n), r in runs.items() if w == world and "error" not in r]
        if not names:
            continue
        steps = len(runs[(world, names[0])]["losses"])
        shown = sorted(set(range(0, steps, args.loss_every)) | {steps - 1})
        lines += [
            "",
            f"## Loss, {world} ranks (mean of the ranks' micro-batch losses; the same batches and initial "
            "weights for every optimizer)",
            "",
            "| step | " + " | ".join(names) + " |",
            "| --- |" + " --- |" * len(names),
        ]
        for i in shown:
            lines.append(
                f"| {i + 1}{' (warm-up)' if i < args.freeze_step else ''} | "
                + " | ".join(f"{runs[(world, n)]['losses'][i]:.4f}" for n in names)
                + " |"
            )
        lines.append("")
        for name in names:
            base_name = OPTIMIZERS[name][2]
            if base_name in names:
                a, b = runs[(world, name)]["losses"], runs[(world, base_name)]["losses"]
                warm = max(abs(x - y) for x, y in zip(a[: args.freeze_step], b[: args.freeze_step]))
                tail = args.loss_tail
                fa, fb = statistics.fmean(a[-tail:]), statistics.fmean(b[-tail:])
                lines.append(
                    f"- {name} vs {base_name}: final loss {a[-1]:.4f} vs {b[-1]:.4f} (difference "
                    f"{a[-1] - b[-1]:+.4f}); mean of the last {tail} steps {fa:.4f} vs {fb:.4f} "
                    f"({fa - fb:+.4f}, {100 * (fa - fb) / fb:+.2f} %); max |difference| during the "
                    f"warm-up {warm:.2e}"
                )
    if throttle_note:
        lines += ["", f"Throttled runs: {throttle_note}"]
    codes = {
        (w, n, kind): r["code"]
        for kind, rs in (("loopback", runs), ("tbf", throttled))
        for (w, n), r in rs.items()
        if "code" in r
    }
    if len(set(codes.values())) > 1:
        lines += [
            "",
            "The library changed during the bench (HEAD+digest of uncommitted changes under shardwise/ "
            "at each run's start):",
            "",
        ] + [f"- {w} ranks {n} ({kind}): {c}" for (w, n, kind), c in codes.items()]
    elif codes:
        lines += ["", f"shardwise at {next(iter(codes.values()))} for every run (HEAD+digest of uncommitted changes)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizers", default="adam,onebitadam,zerooneadam,lamb,onebitlamb")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2, help="rows per rank and step")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--freeze-step", type=int, default=10, help="warm-up steps (freeze_step, var_freeze_step)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam, 1-bit Adam, 0/1 Adam")
    parser.add_argument("--lamb-lr", type=float, default=5e-3, help="LAMB, 1-bit LAMB")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--zoadam-params", default="{}", help="extra ZeroOneAdam params (JSON)")
    parser.add_argument("--bandwidths", default="1gbit,10gbit", help="modelled link rates")
    parser.add_argument("--throttle", default="1gbit", help="tbf rate of the throttled runs ('' = none)")
    parser.add_argument("--throttle-burst", default="256kb")
    parser.add_argument("--throttle-world-sizes", default="2,4")
    parser.add_argument("--throttle-steps", type=int, default=16, help="steps of a throttled run (warm-up included)")
    parser.add_argument("--loss-every", type=int, default=5)
    parser.add_argument("--loss-tail", type=int, default=5, help="steps averaged for the final-loss comparison")
    parser.add_argument(
        "--exact-exchange",
        action="store_true",
        help="diagnostic: the 1-bit optimizers average in full precision instead of compressed "
        "(same schedule), to tell a loss gap of the compression from one of the algorithm",
    )
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--interface", default="lo", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.steps < args.freeze_step + 3 or args.throttle_steps < args.freeze_step + 3:
        parser.error("--steps and --throttle-steps must be at least --freeze-step + 3")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(1))  # so that the namespaces are deleted
    import torch

    versions = f"torch {torch.__version__}, Python {platform.python_version()}"
    names, skipped = [], []
    for name in args.optimizers.split(","):
        if name not in OPTIMIZERS:
            parser.error(f"unknown optimizer {name!r} (known: {', '.join(OPTIMIZERS)})")
        if _available(name):
            names.append(name)
        else:
            skipped.append(name)
            print(f"note: {OPTIMIZERS[name][0]} ({OPTIMIZERS[name][1]}) is not in shardwise yet: skipped", flush=True)
    started = time.perf_counter()
    runs: dict = {}
    for world in (int(w) for w in args.world_sizes.split(",")):
        for name in names:
            r = run(args, name, world, steps=args.steps)
            runs[(world, name)] = r
            print(
                f"[{world} ranks, {name}] "
                + (
                    f"error: {r['error']}"
                    if "error" in r
                    else f"{r['median']:.3f} s/step (blocked {r['wait']:.3f}), payload "
                    f"{_mib(sum(r['delta'][0]['bytes'].values()))} MiB/step, wchar "
                    f"{_mib(r['delta'][0]['io']['wchar'])} MiB/step, final loss {r['losses'][-1]:.4f}, "
                    f"run {r['wall_s']:.0f} s"
                ),
                flush=True,
            )
    throttled: dict = {}
    throttle_note = None
    if args.throttle:
        why_not = throttle_possible()
        if why_not:
            throttle_note = f"not possible here ({why_not}); only the model figures are given."
            print(f"note: throttling {throttle_note}", flush=True)
        else:
            throttle_note = (
                f"each rank in its own network namespace, its veth on a bridge, tbf rate "
                f"{args.throttle} burst {args.throttle_burst} latency 50ms on both ends of every veth "
                f"(each rank sends and receives at most {args.throttle}); {args.throttle_steps} steps, "
                f"measured {args.freeze_step + 2}..{args.throttle_steps}."
            )
            for world in (int(w) for w in args.throttle_world_sizes.split(",") if w):
                with ThrottledNet(world, args.throttle, args.throttle_burst) as net:
                    for name in names:
                        r = run(args, name, world, steps=args.throttle_steps, net=net)
                        throttled[(world, name)] = r
                        print(
                            f"[{world} ranks, {name}, tbf {args.throttle}] "
                            + (
                                f"error: {r['error']}"
                                if "error" in r
                                else f"{r['median']:.3f} s/step (blocked {r['wait']:.3f}), veth tx "
                                f"{_mib(_mean([d['tx'] for d in r['delta']]))} MiB/step/rank, run {r['wall_s']:.0f} s"
                            ),
                            flush=True,
                        )
    text = report(args, runs, throttled, skipped, throttle_note, versions)
    text += f"\nTotal bench time {time.perf_counter() - started:.0f} s.\n"
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
