"""Train a small mixture-of-experts GPT on the Python standard library's own source code.

Every other block's MLP is an ``MoE`` layer (DeepSpeed's ``deepspeed.moe.layer.MoE``, here
``shardwise.moe.layer.MoE``) of ``--experts`` MLP experts, each token routed to ``--k`` of
them; the experts are split over ``--ep`` ranks (each holds ``experts / ep``)::

    shardwise run --nproc 2 examples/train_moe.py --deepspeed_config examples/configs/moe_zero2.json

``--dropless`` routes every token (``drop_tokens=False``); otherwise an expert takes at most
``--capacity`` times its even share of a rank's routes and the rest are dropped (the printed
``dropped`` counts them). The loss adds ``--aux_coef`` times the load-balancing loss. This
version cannot checkpoint experts split over ranks, so the script has no ``--save``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt_model import ByteBlocks, GPTConfig, byte_corpus  # noqa: E402
from moe_gpt import MoEGPT, MoESettings, dropped_routes  # noqa: E402

import shardwise  # noqa: E402
from shardwise.moe.layer import MoE  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps to train")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    parser.add_argument("--k", type=int, default=2, help="experts per token")
    parser.add_argument("--ep", type=int, default=2, help="ranks the experts are split over")
    parser.add_argument("--capacity", type=float, default=1.25, help="capacity factor")
    parser.add_argument("--dropless", action="store_true", help="route every token (drop_tokens=False)")
    parser.add_argument("--moe_every", type=int, default=2, help="an MoE MLP in every n-th block (1: all)")
    parser.add_argument("--aux_coef", type=float, default=0.01, help="weight of the load-balancing loss")
    parser.add_argument("--print_every", type=int, default=25, help="steps between progress lines")
    parser.add_argument(
        "--corpus_bytes", type=int, default=4_000_000, help="bytes of standard-library source to train on"
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    shardwise.add_config_arguments(parser)
    args = parser.parse_args()
    if args.deepspeed_config is None:
        args.deepspeed_config = os.path.join(os.path.dirname(__file__), "configs", "moe_zero2.json")
    return args


def build(args):
    settings = MoESettings(
        num_experts=args.experts,
        k=args.k,
        ep_size=args.ep,
        capacity_factor=args.capacity,
        drop_tokens=not args.dropless,
        every=args.moe_every,
        aux_coef=args.aux_coef,
    )
    config = GPTConfig(
        vocab_size=256, width=args.width, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq_len
    )
    # DeepSpeed's layout: expert-parallel groups are consecutive ranks
    expert_rank = int(os.environ.get("RANK", 0)) % args.ep
    return MoEGPT(config, settings, MoE, expert_rank=expert_rank, seed=args.seed), settings


def report_split(engine, model) -> None:
    """Each rank says which experts it holds (``shardwise.initialize`` bound the layers)."""
    layers = model.moe_layers()
    held = [layer.global_expert_ids() for layer in layers]
    expert_params = sum(p.numel() for layer in layers for p in layer.deepspeed_moe.experts.parameters())
    print(
        f"rank {engine.global_rank}: {len(layers)} MoE layers, experts {held[0] if held else []} of "
        f"{layers[0].num_experts if layers else 0} in each ({len(held[0]) if held else 0} local), "
        f"{expert_params / 1e6:.2f}M expert parameters",
        flush=True,
    )


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
    model, settings = build(args)
    total = sum(p.numel() for p in model.parameters())
    dataset = ByteBlocks(byte_corpus(max_bytes=args.corpus_bytes), seq_len=args.seq_len)
    engine, _, loader, _ = shardwise.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset
    )
    rank0 = engine.global_rank == 0
    if rank0:
        print(
            f"model: {total / 1e6:.2f}M parameters on this rank; corpus: {len(dataset)} blocks of "
            f"{args.seq_len} bytes; {engine.dp_world_size} ranks, global batch {engine.train_batch_size()}; "
            f"{args.experts} experts, top-{args.k}, ep {args.ep}, "
            + ("dropless" if args.dropless else f"capacity factor {args.capacity}"),
            flush=True,
        )
    report_split(engine, model)
    start, start_samples = time.perf_counter(), engine.global_samples
    losses: list[float] = []
    dropped = routes = 0
    stream = iter(loader)
    while engine.global_steps < args.steps:
        try:
            x, y = next(stream)
        except StopIteration:
            stream = iter(loader)
            continue
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        d, r = dropped_routes(model.exp_counts, settings)
        dropped, routes = dropped + d, routes + r
        if rank0 and engine.global_steps % args.print_every == 0:
            print(f"step {engine.global_steps}: loss {losses[-1]:.3f}, dropped {d} of {r} routes", flush=True)
    elapsed = time.perf_counter() - start
    if rank0 and losses:
        tail = sum(losses[-10:]) / len(losses[-10:])
        print(
            f"done: {engine.global_steps} steps in {elapsed:.1f}s, "
            f"{(engine.global_samples - start_samples) / elapsed:.1f} samples/s; "
            f"loss {losses[0]:.3f} -> {tail:.3f} (mean of last 10 micro-steps); "
            f"dropped {dropped / len(losses):.1f} of {routes / len(losses):.0f} routes per micro-step on rank 0",
            flush=True,
        )


if __name__ == "__main__":
    main()
