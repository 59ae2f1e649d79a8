"""A training script whose ranks diverge: the last rank runs one step more than the
others, which then stall (as a rank stuck in data loading would). Started by
test_diverged_ranks.py under ``shardwise run`` and ``torchrun``."""

import argparse
import os
import sys
import time

import shardwise
from shardwise.testing.models import TinyMLP, token_batches

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=0)
parser.add_argument("--offload", action="store_true")
parser.add_argument("--timeout_s", type=float, default=5.0)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--stall_s", type=float, default=600.0)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
zero = {"stage": args.stage}
if args.offload:
    zero["offload_optimizer"] = {"device": "cpu"}
engine, _, _, _ = shardwise.initialize(
    model=TinyMLP(),
    config={
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": zero,
        "comm": {"timeout_s": args.timeout_s},
        "steps_per_print": 1000,
    },
)
steps = args.steps + (1 if rank == world - 1 else 0)
for tokens, targets in token_batches(num_steps=steps, batch=2, seed=rank):
    engine.backward(engine(tokens, targets))
    engine.step()
sys.stdout.write(f"STALL rank={rank} after {engine.global_steps} steps\n")
sys.stdout.flush()
time.sleep(args.stall_s)
