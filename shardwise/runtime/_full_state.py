"""The whole model's state dict from this rank's sharded, tensor-sliced, single-stage
one: ``engine.module_state_dict()`` and ``save_16bit_model``, functions of the module's
stateful part and the ``Placement`` (see [Note: tensor parallelism in checkpoints] and
[Note: pipeline stages in checkpoints] in ``_checkpointing.py``).

[Note: frozen parameters of other ranks]
``exclude_frozen_parameters=True`` names this rank's frozen parameters, as this rank's
module names them: a pipeline stage knows only its own layers, and an expert rank names
its experts by local id, which in the whole model's state dict are another rank's
experts. So each rank leaves its own frozen names out of its state dict before the
stages' and the expert ranks' state dicts are gathered (after the tensor-parallel
gather, whose collectives need the same keys on every tensor rank), and the result lacks
every rank's frozen parameters and only those. DeepSpeed 0.19.8 writes no such file for a
pipeline: its ``PipelineEngine.save_16bit_model`` fails (its ``module_state_dict`` only
works inside ``save_checkpoint``) before any checkpoint, and after a
``load_checkpoint`` rewrites that checkpoint's ``layer_NN-model_states.pt`` files and
saves ``None`` as the 16-bit file; with experts its rank 0 writes its own local experts
only."""

from __future__ import annotations

import os
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

from shardwise import checkpoint as ckpt
from shardwise.checkpoint import TensorSplit
from shardwise.runtime._checkpoint_parts import Writers
from shardwise.runtime._checkpoint_state import ModuleState
from shardwise.runtime._placement import Placement


def save_16bit_model(
    module: ModuleState, place: Placement, save_dir, save_filename: str, *, exclude: frozenset[str] = frozenset()
) -> bool:
    """Write the module's state_dict (in its training dtype) to one file on rank 0.

    ``.safetensors`` names get a safetensors file, written a piece at a time (at stage 3
    a unit at a time: only one unit is ever gathered); anything else (DeepSpeed's default
    ``pytorch_model.bin``) a ``torch.save`` file, which is what Hugging Face loaders read
    and which needs the whole state on rank 0. Tensor-parallel parameters are gathered
    over the tensor group into their full tensors (see [Note: tensor parallelism in
    checkpoints]); a pipeline's stages are all-gathered into the whole model's state dict
    (see [Note: pipeline stages in checkpoints]). Names in ``exclude`` (this rank's frozen
    parameters) are left out of the file, every stage's and expert rank's its own (see
    [Note: frozen parameters of other ranks]). Collective: every rank calls it.
    """
    writers = place.writers
    path = Path(save_dir) / save_filename
    tmp = path.with_name(f".{path.name}.tmp")
    writer = writers.rank == 0
    if writer:
        path.parent.mkdir(parents=True, exist_ok=True)
    if writers.stages > 1 or place.experts is not None:
        state = full_module_state(module.state_dict(), place, exclude=exclude)
        if writer:
            _save_whole({k: v.detach().cpu().clone() for k, v in state.items()}, tmp, path.suffix)
    elif path.suffix == ".safetensors":
        _save_safetensors_by_piece(module, place, tmp, exclude)
    else:
        state = {}
        for piece in module.pieces():
            piece = _gather_slices(writers, piece, place.split_by_key)
            if writer:
                state.update({k: v.detach().cpu().clone() for k, v in piece.items() if k not in exclude})
        if writer:
            torch.save(state, tmp)
    if writer:
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        tmp.replace(path)
    writers.barrier(tag="save_16bit_model")
    return True


def _save_whole(state: dict, tmp: Path, suffix: str) -> None:
    if suffix == ".safetensors":
        safetensors.torch.save_file(state, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(state, tmp)


def frozen_names(module: nn.Module) -> frozenset[str]:
    """The state-dict names of ``module``'s parameters that do not require gradients."""
    return frozenset(name for name, param in module.named_parameters() if not param.requires_grad)


def _save_safetensors_by_piece(module: ModuleState, place: Placement, tmp: Path, exclude: frozenset[str]) -> None:
    """Rank 0 writes the file's header, then each piece's full tensors into place."""
    writer = place.writers.rank == 0
    by_key = place.split_by_key
    kept = [(k, dtype, list(shape)) for k, (dtype, shape) in place.keys.items() if k not in exclude]
    prefix, offsets, _ = ckpt.tensor_file_layout(kept)
    if writer:
        with open(tmp, "wb") as handle:
            handle.write(prefix)
    for piece in module.pieces():
        for key, tensor in _gather_slices(place.writers, piece, by_key).items():
            if writer and key not in exclude:
                ckpt.write_into(tmp, offsets[key], tensor)


def _gather_slices(writers: Writers, state: dict, by_key: dict[str, TensorSplit]) -> dict:
    """``state`` with each tensor-parallel slice replaced by its full tensor, all-gathered
    over the tensor group (collective there: every tensor rank passes the same keys)."""
    if not by_key:
        return state
    out = {}
    for key, tensor in state.items():
        split = by_key.get(key)
        if split is None:
            out[key] = tensor
            continue
        local = tensor.detach().contiguous().reshape(-1)
        gathered = torch.empty(writers.tensor_size * local.numel(), dtype=local.dtype, device=local.device)
        writers.tensor.all_gather_into_tensor(gathered, local, tag=f"full tensor of {key}").wait()
        out[key] = split.full_from(list(gathered.view(writers.tensor_size, -1)))
    return out


def _with_every_expert(state: dict, place: Placement, exclude: frozenset[str]) -> dict:
    """``state`` with this rank's experts replaced by every expert under its global id
    (all-gathered over the data group, in host memory; see [Note: experts in checkpoints]),
    each rank's ``exclude`` left out."""
    experts, splits = place.experts, place.split_by_key
    mine = {experts.store(k): v.detach().cpu() for k, v in state.items() if k in experts.stored and k not in exclude}
    rows = {
        k: (splits[k].index, v.detach().cpu()) for k, v in state.items() if k in experts.split_keys and k not in exclude
    }
    every: dict = {}
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    for rank_experts, rank_rows in place.writers.data.all_gather_object((mine, rows), tag="experts of every rank"):
        for key, value in rank_experts.items():
            every.setdefault(key, value)
        for key, (index, value) in rank_rows.items():
            stacked.setdefault(key, {})[index] = value
    out, placed = {}, False
    for key, value in state.items():
        if key in experts.split_keys:  # an AutoEP stacked weight: every expert rank's rows
            if key in stacked:
                out[key] = torch.cat([stacked[key][i] for i in sorted(stacked[key])])
        elif key not in experts.stored:
            if key not in exclude:
                out[key] = value
        elif not placed:  # every expert where the first local one was, by global id
            out.update(sorted(every.items(), key=lambda item: _by_number(item[0])))
            placed = True
    return out


def _by_number(key: str) -> tuple:
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in key.split("."))


def full_module_state(state: dict, place: Placement, *, exclude: frozenset[str] = frozenset()) -> dict:
    """A module state dict (``ModuleState.state_dict()``'s) with full tensors for
    tensor-parallel parameters (collective over the tensor group), every expert under its
    global id and, in a pipeline, every stage's layers in stage order (all-gathered over
    the pipe group, on every rank, in host memory; a tied weight once); without the names
    in ``exclude`` of any rank (see [Note: frozen parameters of other ranks])."""
    writers = place.writers
    experts = place.experts
    tensor_splits = {k: s for k, s in place.split_by_key.items() if experts is None or k not in experts.split_keys}
    state = _gather_slices(writers, state, tensor_splits)
    if experts is not None:
        state = _with_every_expert(state, place, exclude)
    else:
        state = {k: v for k, v in state.items() if k not in exclude}
    if writers.pipe is None:
        return state
    mine = {k: v.detach().cpu() for k, v in state.items()}
    stages = writers.pipe.all_gather_object(mine, tag="module state dict of every stage")
    merged = {}
    for stage_state in stages:
        for key, value in stage_state.items():
            merged.setdefault(key, value)
    return merged
