"""File names of an engine checkpoint and the consolidation of one into a plain state dict.

An engine checkpoint (``engine.save_checkpoint``) holds ``model.safetensors`` (the
module's state_dict in its training dtype), ``optimizer.safetensors`` (optimizer state by
parameter name and, under fp16/bf16, the fp32 master weights), ``engine_state.safetensors`` and
``rng_rank<R>.safetensors`` (plus ``optimizer_rank<R>.safetensors`` for an optimizer with
per-rank state, the 1-bit family's error buffers). At ZeRO stages 1-3 the sharded tensors continue in parts
(``model-00001.safetensors``, ``optimizer-00001.safetensors``... listed in the manifest's
``skeletons.module_files`` and ``skeletons.optimizer_files``), still one whole tensor per
name, tensor-parallel parameters included (as the model without tensor parallelism holds
them). Because every tensor is stored whole under its name, consolidation needs no
knowledge of the world size, ZeRO stage or tensor-parallel degree that saved it.

The manifest's ``skeletons.frozen`` lists the state-dict keys of the parameters that took
no gradient (``requires_grad=False``) when it was saved, and ``exclude_frozen_parameters``
says whether the checkpoint leaves their tensors out (``save_checkpoint(...,
exclude_frozen_parameters=True)``); see [Note: checkpoints without frozen parameters] in
``runtime/_frozen_checkpoint.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from shardwise.checkpoint._flatten import unflatten_state
from shardwise.checkpoint._read import read_manifest, read_tensors, resolve_tag

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
ENGINE_FILE = "engine_state.safetensors"
EXCLUDES_FROZEN = "exclude_frozen_parameters"
"""The manifest entry saying that the frozen parameters' tensors were left out."""
FROZEN_SKELETON = "frozen"
"""The skeletons entry listing the frozen parameters' state-dict keys."""

logger = logging.getLogger("shardwise")


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


def optimizer_rank_file(rank: int) -> str:
    """The file of optimizer state that differs between ranks (the 1-bit optimizers'
    error-feedback buffers), written only by optimizers that have some."""
    return f"optimizer_rank{rank}.safetensors"


def frozen_keys(manifest: dict) -> list[str] | None:
    """The state-dict keys of the parameters that took no gradient when the checkpoint was
    saved; None for a checkpoint from before shardwise recorded them."""
    return manifest["skeletons"].get(FROZEN_SKELETON)


def excludes_frozen(manifest: dict) -> bool:
    """Whether the checkpoint leaves the frozen parameters' tensors out."""
    return bool(manifest.get(EXCLUDES_FROZEN, False))


def checkpoint_path(load_dir, tag: str | None = None) -> Path:
    """The directory of one checkpoint: ``load_dir/tag`` (``latest``'s tag for None), or
    ``load_dir`` itself when ``tag`` is None and it holds a manifest."""
    load_dir = Path(load_dir)
    if tag is None and (load_dir / "manifest.json").is_file():
        return load_dir
    return load_dir / resolve_tag(load_dir, tag)


def consolidated_sources(load_dir, tag: str | None = None, *, mmap: bool = False) -> dict:
    """What ``consolidate`` returns before the dtype conversion: each state-dict key's tensor
    as stored (views of mapped files with ``mmap``, so a caller converting and writing one
    tensor at a time never holds the model; see ``shardwise convert``). A checkpoint saved
    with ``exclude_frozen_parameters=True`` gives its trainable parameters and buffers only,
    and a warning says so."""
    path = checkpoint_path(load_dir, tag)
    manifest = read_manifest(path)
    skeletons = manifest["skeletons"]
    if excludes_frozen(manifest):
        left_out = frozen_keys(manifest) or []
        logger.warning(
            "%s was saved with exclude_frozen_parameters=True: its %d frozen parameter tensor(s) (%s) are not "
            "in it, so the state dict holds the trainable parameters and buffers only; take the frozen ones "
            "from the base model",
            path,
            len(left_out),
            ", ".join(left_out[:5]) + (", ..." if len(left_out) > 5 else ""),
        )
    module = read_module_state(path, manifest, mmap=mmap)
    masters = {}
    if "optimizer" in skeletons and manifest.get("layout", {}).get("param_dtype") != "float32":
        masters = read_optimizer_state(path, manifest, mmap=mmap).get("master", {})
    aliases = skeletons.get("aliases", {})
    return {key: masters.get(aliases.get(key, key), tensor) for key, tensor in module.items()}


def read_optimizer_state(path, manifest: dict, *, mmap: bool = False) -> dict:
    """The named optimizer state of the checkpoint at ``path``, from all its optimizer files
    (checked as ``read_tensors`` checks them; ``mmap`` as there)."""
    return _read_state(path, manifest, "optimizer", OPTIMIZER_FILE, mmap=mmap)


def read_module_state(path, manifest: dict, *, mmap: bool = False) -> dict:
    """The module state dict of the checkpoint at ``path``, from all its model files."""
    return _read_state(path, manifest, "module", MODEL_FILE, mmap=mmap)


def _read_state(path, manifest: dict, what: str, first_file: str, *, mmap: bool) -> dict:
    skeletons = manifest["skeletons"]
    tensors = {}
    for name in skeletons.get(f"{what}_files", [first_file]):  # one file before parts existed
        tensors.update(read_tensors(path, name, manifest=manifest, mmap=mmap))
    return unflatten_state(tensors, skeletons[what])


def consolidate(load_dir, tag: str | None = None, *, dtype: torch.dtype = torch.float32) -> dict:
    """The full model state dict of a checkpoint, in ``dtype``, ready for ``load_state_dict``.

    Floating-point weights come from the fp32 master copies when the run trained in
    fp16/bf16 (so nothing is lost to rounding), otherwise from the module state; tied
    weights get the same values under every name; buffers keep integer dtypes.

    Args:
        load_dir: the ``save_dir`` given to ``save_checkpoint`` (or a checkpoint directory
            itself, when ``tag`` is None and it holds a manifest).
        tag: which checkpoint; None reads ``latest``.
        dtype: the floating-point dtype of the result.
    """
    return {
        key: value.to(dtype) if value.is_floating_point() else value
        for key, value in consolidated_sources(load_dir, tag).items()
    }
