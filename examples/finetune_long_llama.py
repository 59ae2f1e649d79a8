"""Fine-tune a small Hugging Face Llama on long sequences split over the ranks (DeepSpeed-Ulysses
/ ALST), on the Python standard library's own source code as bytes::

    shardwise run --nproc 2 examples/finetune_long_llama.py --seq_len 4096

The model is built from a config (no download). What DeepSpeed's ALST tutorial does, with
shardwise's names at DeepSpeed's paths:

- ``UlyssesSPAttentionHF.register_with_transformers`` makes the model's ``sdpa`` attention run
  over the whole sequence with a share of the heads, and returns the ``mpu`` that
  ``shardwise.initialize`` trains on;
- ``UlyssesSPDataLoaderAdapter`` gives each rank its piece of every sequence (labels shifted
  before the split), each rank's batch in turn;
- ``shardwise.sequence.loss.causal_lm_loss`` averages the pieces' token losses over the whole
  sequences;
- ``--tiled_mlp N`` runs each MLP in ``N`` tiles (``TiledMLP``), and ``--checkpoint`` each
  decoder layer under activation checkpointing, so long sequences fit in less memory.

Each rank prints the length of its piece and the peak memory its process reached.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt_model import byte_corpus  # noqa: E402

import shardwise  # noqa: E402
from shardwise.runtime.sequence_parallel.ulysses_sp import (  # noqa: E402
    TiledMLP,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
)
from shardwise.sequence.loss import causal_lm_loss  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq_len", type=int, default=4096, help="tokens (bytes) per sequence")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--sp", type=int, default=None, help="sequence-parallel size (default: every rank)")
    parser.add_argument("--tiled_mlp", type=int, default=0, help="run each MLP in this many tiles (0: untiled)")
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing of each layer")
    parser.add_argument("--zero", type=int, default=2, help="ZeRO stage")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--print_every", type=int, default=5)
    parser.add_argument("--corpus_bytes", type=int, default=2_000_000)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    return parser.parse_args()


def tiled_mlp_forward(self, x):
    """LlamaMLP.forward in ``self.tiles`` tiles of the sequence."""

    def mlp(module, x):
        return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))

    return TiledMLP.apply(mlp, self, x, self.tiles, None)


def build_model(args):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if args.tiled_mlp:
        for layer in model.model.layers:
            layer.mlp.tiles = args.tiled_mlp
            layer.mlp.forward = tiled_mlp_forward.__get__(layer.mlp)
    if args.checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def sequences(args, rank: int, world: int) -> list[dict]:
    """This rank's sequences: consecutive windows of the corpus, rank-strided."""
    data = byte_corpus(max_bytes=args.corpus_bytes).long()
    windows = (len(data) - 1) // args.seq_len
    out = []
    for i in range(rank, min(windows, args.steps * world), world):
        ids = data[i * args.seq_len : (i + 1) * args.seq_len]
        out.append({"input_ids": ids, "labels": ids, "position_ids": torch.arange(args.seq_len)})
    return out


def main() -> None:
    args = parse_args()
    shardwise.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    sp = args.sp or world
    model = build_model(args)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, micro_batch_size=1)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero},
        "sequence_parallel_size": sp,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine, _, _, _ = shardwise.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    loader = UlyssesSPDataLoaderAdapter(
        DataLoader(sequences(args, rank, world), batch_size=1),
        mpu.get_sequence_parallel_rank(),
        group,
        mpu.get_sequence_parallel_world_size(),
        "cpu",
    )
    start = time.perf_counter()
    for step, batch in zip(range(1, args.steps + 1), loader):
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = causal_lm_loss(logits, batch["shift_labels"], group=group)
        engine.backward(loss)
        engine.step()
        if rank == 0 and (step % args.print_every == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - start:.1f} s", flush=True)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"rank {rank}: sequence {args.seq_len} split over {sp} ranks, piece {batch['input_ids'].shape[1]} tokens, "
        f"peak memory {peak_mib:.0f} MiB",
        flush=True,
    )


if __name__ == "__main__":
    main()
