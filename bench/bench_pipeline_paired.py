"""Paired pipeline comparison for a loaded machine: shardwise variants alternating step by step
in one pair of processes.

On a shared machine whose load swings by 2-5x within a minute, separate runs per variant (as in
``bench_pipeline.py``) compare different loads more than different variants. Here each rank
builds one ``PipelineEngine`` per variant (same seeded layers, same micro-batches) and the steps
alternate: step k of every variant runs back to back, the order rotating each step, so a load
swing lands on all variants alike. Reported per variant: the median step time and the median
over steps of its time / the first variant's time in the same step (the paired ratio).

Variants: ``<schedule>[+<partition_method>]``: ``default`` (no ``pipeline.schedule``) or a
schedule name; ``+uniform`` (the default here, as in ``bench_pipeline.py``), ``+parameters`` or
``+profile`` (the layers timed on the first micro-batch). The model is ``bench_pipeline.py``'s::

    python bench/bench_pipeline_paired.py --variants 1f1b,default,default+profile --micro-batch 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import _micro_batches, _module  # noqa: E402
from bench_tensor_parallel import REPO, _free_port  # noqa: E402


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import shardwise
    import shardwise.pipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    data = _micro_batches(args)
    engines, parts = [], []
    for variant in args.variants.split(","):
        schedule, _, partition = variant.partition("+")
        model = _module(args, shardwise.pipe, partition or "uniform", data[0])
        config = {
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": args.micro_batches,
            "steps_per_print": 10**9,
            "pipeline": {} if schedule == "default" else {"schedule": schedule},
        }
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        engine, *_ = shardwise.initialize(model=model, optimizer=optimizer, config=config)
        engines.append(engine)
        parts.append(list(model.parts))
    n = len(engines)
    times = [[] for _ in range(n)]
    losses = [[] for _ in range(n)]
    m = args.micro_batches
    for step in range(args.steps):
        batch = data[(step % 4) * m : (step % 4 + 1) * m]  # 4 distinct batches, reused
        for k in range(n):
            v = (step + k) % n  # rotate the order every step
            dist.barrier()
            start = time.perf_counter()
            loss = engines[v].train_batch(iter(batch))
            times[v].append(time.perf_counter() - start)
            losses[v].append(float(loss))
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"times": times, "losses": losses, "parts": parts}))
    dist.barrier()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="1f1b,default,default+profile")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--mlp-ratio", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=2, help="leading steps of each variant left out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    variants = args.variants.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
        cmd += ["--master_port", str(_free_port()), __file__, "--worker", "--result", str(result)]
        for key in ("variants", "vocab", "width", "mlp_ratio", "blocks", "seq_len", "micro_batch", "micro_batches"):
            cmd += ["--" + key.replace("_", "-"), str(getattr(args, key))]
        cmd += ["--steps", str(args.steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDWISE_ACCELERATOR": "cpu"}
        env["PYTHONPATH"] = f"{REPO}:{os.environ.get('PYTHONPATH', '')}"
        load_before = os.getloadavg()
        started = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        out = json.loads(result.read_text())
    w = args.warmup
    times = [t[w:] for t in out["times"]]
    print(
        f"vocab {args.vocab}, micro-batch {args.micro_batch} x {args.micro_batches}, {len(times[0])} steps per "
        f"variant after {w} left out; load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}; "
        f"{wall:.0f} s"
    )
    print("| variant | boundaries | median s/step | paired ratio to " + variants[0] + " (median, min-max) |")
    print("| --- | --- | ---: | --- |")
    for v, name in enumerate(variants):
        ratios = [a / b for a, b in zip(times[v], times[0])]
        print(
            f"| {name} | {out['parts'][v]} | {statistics.median(times[v]):.3f} | "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |"
        )
    same = all(out["losses"][v] == out["losses"][0] for v in range(len(variants)))
    print(f"losses identical across variants: {same} (first {out['losses'][0][:3]})")


if __name__ == "__main__":
    main()
