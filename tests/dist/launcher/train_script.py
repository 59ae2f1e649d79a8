"""A small training script the launcher tests start on every rank."""

import argparse
import os
import sys

import shardwise
from shardwise.testing.models import TinyMLP, token_batches

parser = shardwise.add_config_arguments(argparse.ArgumentParser())
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--crash_rank", type=int, default=-1)
args = parser.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# one write per line: ranks share the launcher's stdout, and print() writes the newline
# separately, so lines of different ranks could interleave
sys.stdout.write(
    f"RANKINFO rank={rank} local_rank={os.environ['LOCAL_RANK']} world={world} "
    f"passed_local_rank={int(any(a.startswith('--local_rank') for a in sys.argv))} "
    f"MY_VAR={os.environ.get('MY_VAR')}\n"
)
sys.stdout.flush()
engine, _, _, _ = shardwise.initialize(
    model=TinyMLP(),
    config={
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "steps_per_print": 1000,
    },
)
for step, (tokens, targets) in enumerate(token_batches(num_steps=args.steps, batch=2, seed=rank)):
    if step == 1 and rank == args.crash_rank:
        raise RuntimeError(f"injected failure on rank {rank}")
    engine.backward(engine(tokens, targets))
    engine.step()
checksum = sum(float(p.detach().sum()) for p in engine.module.parameters())
sys.stdout.write(f"DONE rank={rank} steps={engine.global_steps} checksum={checksum:.6f}\n")
sys.stdout.flush()
