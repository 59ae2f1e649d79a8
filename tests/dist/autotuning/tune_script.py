"""A training script the autotuning tests tune: TinyMLP through ``shardwise.initialize``
with the config of ``--deepspeed_config``. ``--crash_micro`` makes the runs of one
micro-batch size fail right after ``initialize``; a run that trains to the end writes
what it trained with to ``--done_file``."""

import argparse
import json
import os
from pathlib import Path

import shardwise
from shardwise.testing.models import TinyMLP, token_batches

parser = shardwise.add_config_arguments(argparse.ArgumentParser())
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--crash_micro", type=int, default=-1)
parser.add_argument("--done_file", default="")
args = parser.parse_args()

config = json.loads(Path(args.deepspeed_config).read_text())
stage = config["zero_optimization"]["stage"]
rank = int(os.environ["RANK"])
engine, _, _, _ = shardwise.initialize(model=TinyMLP(), config=args.deepspeed_config)
micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
if micro == args.crash_micro:
    raise RuntimeError(f"injected crash at micro-batch {micro}")
for tokens, targets in token_batches(num_steps=args.steps * gas, batch=micro, seed=rank):
    engine.backward(engine(tokens, targets))
    engine.step()
if rank == 0 and args.done_file:
    done = {"stage": stage, "micro": micro, "gas": gas, "steps": engine.global_steps}
    Path(args.done_file).write_text(json.dumps(done))
