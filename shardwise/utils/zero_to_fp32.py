"""DeepSpeed's ``zero_to_fp32`` functions over shardwise checkpoints.

A shardwise checkpoint stores every tensor whole under its name whatever the ZeRO stage,
world size and tensor-parallel degree that saved it, so consolidation is reading (see
``shardwise.checkpoint.consolidate``); weights of fp16/bf16 runs come from the fp32
master copies. ``shardwise convert`` does the same from the command line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from shardwise.checkpoint import CheckpointError, consolidate, read_manifest
from shardwise.checkpoint.layout import checkpoint_path, frozen_keys


def _without_frozen(state: dict, checkpoint_dir, tag) -> dict:
    """``state`` without the keys the checkpoint records as frozen parameters."""
    path = checkpoint_path(checkpoint_dir, tag)
    frozen = frozen_keys(read_manifest(path))
    if frozen is None:
        raise CheckpointError(
            f"{path} does not record which parameters were frozen (it was saved by an older shardwise), so "
            "exclude_frozen_parameters=True cannot leave them out; call without it and drop the frozen names "
            "from the returned state dict yourself"
        )
    frozen = set(frozen)
    return {key: value for key, value in state.items() if key not in frozen}


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir, tag=None, exclude_frozen_parameters=False, lazy_mode=False
) -> dict:
    """The full fp32 state dict of the checkpoint ``checkpoint_dir/tag`` (tag None: the one
    named in ``latest``), on the CPU, ready for ``model.load_state_dict``.

    ``exclude_frozen_parameters`` leaves out the parameters that took no gradient in the
    run that saved it (the manifest records them). A checkpoint saved with
    ``save_checkpoint(..., exclude_frozen_parameters=True)`` holds the trainable
    parameters and buffers only: so does the state dict, and a warning says so.

    ``lazy_mode`` is accepted: the tensors are real (``.contiguous()`` on them, as
    DeepSpeed's lazy tensors need, works)."""
    del lazy_mode
    checkpoint_dir = Path(checkpoint_dir)
    if tag is None and not (checkpoint_dir / "latest").is_file():
        raise ValueError(f"Unable to find 'latest' file at {checkpoint_dir / 'latest'}; pass tag=")
    state = consolidate(checkpoint_dir, tag, dtype=torch.float32)
    return _without_frozen(state, checkpoint_dir, tag) if exclude_frozen_parameters else state


def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    for unit, factor in (
        ("GIB", 2**30),
        ("MIB", 2**20),
        ("KIB", 2**10),
        ("GB", 10**9),
        ("MB", 10**6),
        ("KB", 10**3),
        ("B", 1),
    ):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    raise ValueError(f"max_shard_size {size!r} is not a size such as '5GB', '500MB' or a number of bytes")


def _shards(state: dict, max_bytes: int | None) -> list[list[str]]:
    """Keys split into files of at most ``max_bytes`` (a tensor larger than that gets its own file)."""
    groups, current, used = [], [], 0
    for key, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if current and max_bytes is not None and used + size > max_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(key)
        used += size
    return groups + [current] if current or not groups else groups


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size="5GB",
    safe_serialization=False,
    tag=None,
    exclude_frozen_parameters=False,
) -> None:
    """Write the checkpoint's full fp32 state dict into ``output_dir`` as
    ``pytorch_model.bin`` (``model.safetensors`` with ``safe_serialization``), split into
    ``pytorch_model-00001-of-0000N.bin`` files plus a Hugging Face index JSON when larger
    than ``max_shard_size`` (None: one file)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    groups = _shards(state, None if max_shard_size is None else _parse_size(max_shard_size))
    os.makedirs(output_dir, exist_ok=True)
    stem, suffix = name.rsplit(".", 1)
    weight_map = {}
    for i, keys in enumerate(groups, start=1):
        file = name if len(groups) == 1 else f"{stem}-{i:05d}-of-{len(groups):05d}.{suffix}"
        part = {k: state[k].contiguous().clone() for k in keys}  # clone: tied names share storage
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(part, os.path.join(output_dir, file), metadata={"format": "pt"})
        else:
            torch.save(part, os.path.join(output_dir, file))
        weight_map.update(dict.fromkeys(keys, file))
    if len(groups) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        with open(os.path.join(output_dir, f"{name}.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None) -> torch.nn.Module:
    """Move ``model`` to the CPU, load the checkpoint's fp32 weights into it and return it
    (a plain module afterwards: build a new engine to train it further)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model
