"""``shardwise convert``: one full state-dict file from any shardwise checkpoint.

The checkpoint may come from any world size, ZeRO stage and tensor-parallel degree;
nothing about the saving job is needed. Weights of fp16/bf16 runs come from their fp32 master copies.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from shardwise.checkpoint import CheckpointError, consolidate, tensor_file_layout, write_into
from shardwise.checkpoint.layout import consolidated_sources

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def convert(checkpoint, output, *, tag: str | None = None, dtype: str = "fp32") -> Path:
    """Write the consolidated state dict of ``checkpoint`` to ``output`` (safetensors, or
    ``torch.save`` for ``.bin`` / ``.pt`` names); returns the output path.

    The safetensors output is written a tensor at a time from the mapped checkpoint files
    (into ``<output>.partial``, renamed when complete), so converting a model larger than
    memory needs only its largest tensor in memory. ``torch.save`` needs the whole state."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.suffix in (".bin", ".pt", ".pth"):
        state = consolidate(checkpoint, tag, dtype=_DTYPES[dtype])
        torch.save({k: v.contiguous().clone() for k, v in state.items()}, output)  # untie shared storage
        return output
    sources = consolidated_sources(checkpoint, tag, mmap=True)
    target = _DTYPES[dtype]
    out_dtype = {k: target if v.is_floating_point() else v.dtype for k, v in sources.items()}
    prefix, offsets, _ = tensor_file_layout([(k, out_dtype[k], list(v.shape)) for k, v in sources.items()])
    partial = output.with_name(output.name + ".partial")
    try:
        with open(partial, "wb") as handle:
            handle.write(prefix)
        for key, tensor in sources.items():
            write_into(partial, offsets[key], tensor.to(out_dtype[key]))
        with open(partial, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(partial, output)
    finally:
        partial.unlink(missing_ok=True)
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
