"""A user script in DeepSpeed's style (``import deepspeed.comm as dist``) whose last rank
either issues one collective of the functional API more than rank 0 or leaves with
``sys.exit(N)``, while rank 0 stalls (as a rank stuck in data loading would). Started by
test_diverged_ranks.py under plain torchrun."""

import argparse
import atexit
import os
import sys
import time
from datetime import timedelta

import torch

import shardwise
import shardwise.comm as dist
from shardwise.testing.models import TinyMLP

parser = argparse.ArgumentParser()
parser.add_argument("--op", choices=["all_reduce", "reduce_scatter_tensor"], default=None)
parser.add_argument("--exit", type=int, default=None, help="the last rank calls sys.exit(EXIT)")
parser.add_argument("--group_timeout_s", type=float, default=1800.0)
parser.add_argument(
    "--engine_timeout_s", type=float, default=None, help="build an engine whose config sets comm.timeout_s"
)
parser.add_argument("--stall_s", type=float, default=600.0)
args = parser.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# Registered before shardwise's exit hook, so it runs after it: only on the clean path,
# since a failed rank leaves through os._exit.
atexit.register(lambda: print(f"rank {rank} passed the exit barrier", flush=True))
dist.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=args.group_timeout_s))
if args.engine_timeout_s is not None:
    shardwise.initialize(
        model=TinyMLP(),
        config={
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "comm": {"timeout_s": args.engine_timeout_s},
            "steps_per_print": 1000,
        },
    )
in_step = torch.ones(4)
dist.all_reduce(in_step)  # every rank: the ranks are in step up to here
if rank == world - 1:
    if args.exit is not None:
        sys.exit(args.exit)
    if args.op == "all_reduce":
        dist.all_reduce(torch.ones(4))
    elif args.op == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(4))
else:
    time.sleep(args.stall_s)
print(f"rank {rank} done", flush=True)
