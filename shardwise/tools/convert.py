"""``shardwise convert``: one full state-dict file from any shardwise checkpoint.

The checkpoint may come from any world size and ZeRO stage; nothing about the saving job
is needed. Weights of fp16/bf16 runs come from their fp32 master copies.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from shardwise.checkpoint import CheckpointError, consolidate

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def convert(checkpoint, output, *, tag: str | None = None, dtype: str = "fp32") -> Path:
    """Write the consolidated state dict of ``checkpoint`` to ``output`` (safetensors, or
    ``torch.save`` for ``.bin`` / ``.pt`` names); returns the output path."""
    state = consolidate(checkpoint, tag, dtype=_DTYPES[dtype])
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous().clone() for k, v in state.items()}  # untie shared storage
    if output.suffix in (".bin", ".pt", ".pth"):
        torch.save(state, output)
    else:
        from safetensors.torch import save_file
        save_file(state, str(output), metadata={"format": "pt"})
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise convert", description=__doc__)
    parser.add_argument("checkpoint", help="the save_dir of save_checkpoint (or one checkpoint directory)")
    parser.add_argument("output", help="output file: .safetensors (default format) or .bin/.pt")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    parser.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES))
    args = parser.parse_args(argv)
    try:
        path = convert(args.checkpoint, args.output, tag=args.tag, dtype=args.dtype)
    except CheckpointError as exc:
        print(f"shardwise convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
