"""Train a small GPT on the Python standard library's own source code (byte tokens).

Runs on CPU with gloo (or GPUs with NCCL) on as many ranks as the launcher starts:

    torchrun --nproc_per_node 2 examples/train_gpt.py --deepspeed_config examples/configs/zero0.json

The training loop is a DeepSpeed loop; switching ZeRO stage, precision or batch sizes is
a change of config file, not of this script. ``--save DIR`` checkpoints every
``--save_interval`` steps and at the end; ``--resume DIR`` continues from the newest
checkpoint there (starting fresh if it has none), so a run started with
``--save ckpt --resume ckpt`` picks up where an interrupted one stopped, data included.

The data-efficiency sections work by config too (``examples/configs/zero1_*.json``): the
legacy ``curriculum_learning`` and ``progressive_layer_drop`` reach the model's forward;
``data_efficiency.data_routing.random_ltd`` converts the model's blocks first;
``data_sampling.curriculum_learning`` samples by the ``rarity`` metric, whose index files the
demo writes on first use where the config's paths point (see ``gpt_data.py``);
``data_sampling.dynamic_batching`` trains on variable-length paragraphs of code in
token-budget batches, with the learning rate scaled to each batch's size.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt_data import CodeParagraphs, pad_collate, prepare_curriculum_index  # noqa: E402
from gpt_model import GPT, Block, ByteBlocks, GPTConfig, byte_corpus  # noqa: E402

import shardwise  # noqa: E402
from shardwise.compression.compress import init_compression  # noqa: E402
from shardwise.runtime.data_pipeline.data_routing import convert_to_random_ltd  # noqa: E402
from shardwise.runtime.data_pipeline.data_sampling import (  # noqa: E402
    get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps to train")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument(
        "--corpus_bytes", type=int, default=4_000_000, help="bytes of standard-library source to train on"
    )
    parser.add_argument(
        "--save", metavar="DIR", default=None, help="save a checkpoint here every --save_interval steps and at the end"
    )
    parser.add_argument("--save_interval", type=int, default=50, help="steps between checkpoints")
    parser.add_argument(
        "--resume",
        metavar="DIR",
        default=None,
        help="continue from the newest checkpoint in DIR (start fresh if there is none)",
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    shardwise.add_config_arguments(parser)
    args = parser.parse_args()
    if args.deepspeed_config is None:
        args.deepspeed_config = os.path.join(os.path.dirname(__file__), "configs", "zero0.json")
    return args


def batches(loader, *, epoch: int, skip: int):
    """Yield ``(epoch, micro-batches of that epoch done, batch)`` forever, starting at
    micro-batch ``skip`` of ``epoch``: the data position a checkpoint records. Each pass
    sets the loader's epoch, which seeds its shuffle, so a resumed run sees the order the
    interrupted one would have (skipped batches are read and dropped: cheap here; a large
    dataset would want a sampler that starts mid-epoch). The curriculum sampler's position
    is in the engine's checkpoint: its loader is never skipped."""
    if hasattr(loader, "data_sampler") and hasattr(loader, "post_process_func"):
        skip = 0
    while True:
        loader.epoch = epoch
        for done, batch in enumerate(itertools.islice(loader, skip, None), start=skip + 1):
            yield epoch, done, batch
        epoch, skip = epoch + 1, 0


def resume(engine, directory) -> dict:
    """Load the newest checkpoint in ``directory`` (model, optimizer, scheduler, counters,
    RNG) and return the data position saved with it; a directory without checkpoints
    starts at the beginning (``load_checkpoint`` warns and returns ``(None, None)``)."""
    path, client_state = engine.load_checkpoint(directory)
    if path is None:
        return {"epoch": 0, "micro_batches": 0}
    position = client_state["data"]
    if engine.global_rank == 0:
        print(
            f"resumed from {path} at step {engine.global_steps} (epoch {position['epoch']}, "
            f"micro-batch {position['micro_batches']})",
            flush=True,
        )
    return position


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    # under ZeRO-3 the model is built partitioned: no rank ever holds all of it
    with shardwise.zero.Init(config_dict_or_path=args.deepspeed_config, enabled=stage == 3):
        model = GPT(
            GPTConfig(
                vocab_size=256, width=args.width, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq_len
            )
        )
    if "compression_training" in ds_config:  # QAT / pruning: swap the named layers before initialize
        model = init_compression(model, ds_config)
    sampling = ds_config.get("data_efficiency", {}).get("data_sampling", {})
    if ds_config.get("data_efficiency", {}).get("data_routing", {}).get("random_ltd", {}).get("enabled"):
        model = convert_to_random_ltd(model, Block)  # the config's random_ltd_layer_id pick among them
    dynamic = sampling.get("dynamic_batching", {}).get("enabled", False)
    corpus = byte_corpus(max_bytes=args.corpus_bytes)
    dataset = (CodeParagraphs if dynamic else ByteBlocks)(corpus, seq_len=args.seq_len)
    if sampling.get("curriculum_learning", {}).get("enabled"):
        shardwise.init_distributed()  # the analyzer maps on every rank
        prepare_curriculum_index(ds_config["data_efficiency"], dataset, corpus)
    engine, _, loader, lr_scheduler = shardwise.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=None if dynamic else dataset
    )
    if dynamic:
        if "scheduler" in ds_config:
            raise SystemExit(
                "with dynamic_batching the demo scales a constant learning rate to each batch; remove the "
                "config's 'scheduler' section"
            )
        loader, lr_scheduler, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
            dataset, engine, dataset_seqlens=dataset.seqlens(), dataloader_collate_fn=pad_collate
        )
    rank0 = engine.global_rank == 0
    if rank0:
        print(
            f"model: {sum(getattr(p, 'ds_numel', p.numel()) for p in model.parameters()) / 1e6:.2f}M parameters; "
            f"corpus: {len(dataset)} {'paragraphs of up to' if dynamic else 'blocks of'} {args.seq_len} bytes; "
            f"{engine.dp_world_size} ranks, global batch {engine.train_batch_size()}",
            flush=True,
        )
    position = resume(engine, args.resume) if args.resume else {"epoch": 0, "micro_batches": 0}
    if dynamic and "lr_scaling" in position:
        lr_scheduler.load_state_dict(position["lr_scaling"])  # the engine saves no scheduler of ours
    saved_step, start, start_samples = engine.global_steps, time.perf_counter(), engine.global_samples
    losses: list[float] = []
    stream = batches(loader, epoch=position["epoch"], skip=position["micro_batches"])
    while engine.global_steps < args.steps:
        epoch, done, (x, y) = next(stream)
        x, y = x.to(engine.device), y.to(engine.device)
        loss = engine(x, y)
        engine.backward(loss)
        steps_before = engine.global_steps
        engine.step()
        if dynamic and engine.global_steps != steps_before:
            lr_scheduler.step()  # the rate scaled to the next batch's sample count
        losses.append(loss.item())
        position = {"epoch": epoch, "micro_batches": done}
        if dynamic:
            position["lr_scaling"] = lr_scheduler.state_dict()
        # global_steps moves only on the micro-step that ends a step: one save, at a step boundary
        if args.save and engine.global_steps != saved_step and engine.global_steps % args.save_interval == 0:
            engine.save_checkpoint(args.save, client_state={"data": position})
            saved_step = engine.global_steps
    elapsed = time.perf_counter() - start
    if args.save and engine.global_steps != saved_step:
        engine.save_checkpoint(args.save, client_state={"data": position})
    if rank0 and losses:
        tail = sum(losses[-10:]) / len(losses[-10:])
        print(
            f"done: {engine.global_steps} steps in {elapsed:.1f}s, "
            f"{(engine.global_samples - start_samples) / elapsed:.1f} samples/s; "
            f"loss {losses[0]:.3f} -> {tail:.3f} (mean of last 10 micro-steps)",
            flush=True,
        )


if __name__ == "__main__":
    main()
