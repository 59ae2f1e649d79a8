"""What the engine saves and restores; the file format itself lives in shardwise.checkpoint.

Layout of one checkpoint directory (every tensor is stored whole under a parameter name,
never a rank or an optimizer index, so any later layout can read it):
- ``model.safetensors``: the module's state_dict; the parameters of ZeRO buckets (stages
  1-3) and of tensor-parallel layers are in ``model-00001.safetensors`` and on, each rank
  writing its elements into place (see [Note: shards written in place] in
  ``_checkpoint_parts.py``).
- ``optimizer.safetensors``: optimizer state per parameter name, plus fp32 master
  weights when the module trains in fp16/bf16; the per-element tensors of sharded stages
  and of tensor-parallel parameters are in ``optimizer-00001.safetensors`` and on.
- ``engine_state.safetensors``: tensors of the LR scheduler, loss scaler, client state and
  training features (curriculum, layer drop).
- ``rng_rank<R>.safetensors``: each rank's random number generator states (R: global rank).
- ``optimizer_rank<R>.safetensors``: optimizer state that differs between ranks, when the
  optimizer has some (``optimizer.rank_state_dict()``: the 1-bit optimizers' error
  buffers); read back by the same global rank at the same data-parallel world size.
- ``manifest.json``: counters, layout, and the structure (skeleton) of each state above.

[Note: tensor parallelism in checkpoints]
A tensor-parallel parameter is stored as the full tensor of the model without tensor
parallelism (a Hugging Face model's own state dict: Conv1D weights ``[in, out]``,
stacked q|k|v in q, k, v order), its optimizer state and fp32 master likewise; each
tensor rank writes its slice into place (``TensorSplit``, see [Note: tensor-parallel
slices of stored tensors] in ``checkpoint/_tensor_split.py``) and tensor rank 0 writes
what every tensor rank holds alike. So the format has no tensor-parallel keys at all:
consolidation and a load without tensor parallelism read it as any checkpoint, and a
load into a tensor-parallel layout cuts each rank's slice out of the full tensors
(``_module_to_layout``, ``_optimizer_to_layout``), checking every shape against the
model before anything is loaded. ``engine.module_state_dict()`` and
``save_16bit_model`` gather the slices over the tensor group into the same full tensors,
and ``load_module_state_dict`` cuts them like a checkpoint load.

[Note: pipeline stages in checkpoints]
A pipeline module names its parameters by global layer index (``"3.fc.weight"``) and its
tied layers ``tied_modules.<key>.<attr>``, names no stage count changes. So a pipeline
checkpoint is the checkpoint of the whole model: each stage writes its own layers'
tensors (parameters, buffers, optimizer state, fp32 masters) into the shared part files,
all of them as parts (``model.safetensors`` and ``optimizer.safetensors`` then hold only
what is not per parameter), a tied weight once, by the first stage holding it; global
rank 0 merges the stages' skeletons (``_merge_stage_skeletons``) into one manifest. A
load at any number of stages reads the names its stage now holds (every copy of a tied
weight reads the one stored tensor) and ignores the rest; consolidation sees one model.
``engine.module_state_dict()`` and ``save_16bit_model`` all-gather the stages' state
dicts over the pipe group, so every rank gets the whole model's (in host memory).

[Note: experts in checkpoints]
An MoE layer with ``ep_size > 1`` holds experts ``r * L .. r * L + L - 1`` on expert rank
``r`` as its local experts ``0 .. L - 1``. A checkpoint stores every expert under its
global id (``...deepspeed_experts.<global>...``), its optimizer state and fp32 master
likewise: the checkpoint of the same model with every expert local (``ep_size=1``), so
consolidation sees one model, and a load at any ``ep_size`` (and world size) takes its
experts by global id and renames them to its local ids (``ExpertNames`` in
``_placement.py``). The ranks holding one expert (its expert-data-parallel group) write
it together, as data ranks write a shared tensor: each its shard of a ZeRO bucket, or its
``1 / n`` of a tensor they all hold whole (stage 0), always into the part files; the lists
of tensors and the skeletons are merged over the data group as they are over stages.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from pathlib import Path

import torch

from shardwise import checkpoint as ckpt
from shardwise.checkpoint import CheckpointError, TensorSplit
from shardwise.checkpoint import layout as ckpt_layout
from shardwise.runtime import _frozen_checkpoint as frozen
from shardwise.runtime._checkpoint_parts import (
    Writers,
    block_groups,
    block_key,
    whole_group,
    without_names,
    write_parts,
)
from shardwise.runtime._checkpoint_state import ModuleState, OptimizerState, Stateful
from shardwise.runtime._placement import Placement
from shardwise.zero._strategy import MASTER_KEY

logger = logging.getLogger("shardwise")

_MODEL, _OPTIMIZER, _ENGINE = ckpt_layout.MODEL_FILE, ckpt_layout.OPTIMIZER_FILE, ckpt_layout.ENGINE_FILE
_rng_file = ckpt_layout.rng_file
_optimizer_rank_file = ckpt_layout.optimizer_rank_file

CHECKPOINT_PART_BYTES = 1 << 30
"""Bytes of sharded tensors per part file (see [Note: shards written in place] in
``_checkpoint_parts.py``)."""


def save(
    parts: Stateful,
    place: Placement,
    save_dir,
    *,
    tag,
    save_latest: bool,
    tag_validation: str,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write a checkpoint of ``parts`` under ``save_dir/tag`` (default ``global_step<N>``),
    this rank writing what ``place`` says it holds. Collective: every rank calls it, with
    the same ``save_dir`` and ``tag`` (``tag_validation``: the config's ``Ignore`` / ``Warn``
    / ``Fail`` for a tag that differs). ``exclude_frozen_parameters`` leaves the parameters
    that take no gradient out (see [Note: checkpoints without frozen parameters] in
    ``_frozen_checkpoint.py``)."""
    writers = place.writers
    tag = str(tag) if tag is not None else f"global_step{parts.counters.global_steps}"
    _check_same_directory(place, save_dir)
    _check_tag_agrees(writers, tag, tag_validation)
    if writers.rank == 0:
        _remove_stale_staging(save_dir, tag)
    staging = ckpt.begin_checkpoint(save_dir, tag, clean=writers.rank == 0)
    writers.barrier(tag=f"checkpoint {tag}: staging created")
    skeletons: dict = {}
    # collective for sharded and tensor-parallel state: every rank takes part
    records = {}
    if parts.optimizer is not None:
        records, skeletons["optimizer"], skeletons["optimizer_files"] = _write_optimizer(
            parts.optimizer, place, staging
        )
    left_out = frozen.left_out(place, exclude_frozen_parameters)
    module_records, skeletons["module"], skeletons["module_files"] = _write_module(
        parts.module, place, staging, left_out=left_out
    )
    records.update(module_records)
    skeletons["aliases"] = {k: v for k, v in place.aliases.items() if place.name_of_key.get(k) not in left_out}
    skeletons[ckpt_layout.FROZEN_SKELETON] = frozen.stored_frozen_keys(place)
    rank_records, rank_skeletons = _write_rank_files(parts, place, staging, skeletons)
    records.update(rank_records)
    merge = writers.stages > 1 or place.experts is not None  # skeletons differ between ranks
    shares = writers.tensor_rank == 0 and (writers.data.rank == 0 or place.experts is not None)
    all_records = writers.all_gather_object(
        (place.global_rank, records, rank_skeletons, skeletons if merge and shares else None),
        tag="checkpoint records",
    )
    if writers.rank == 0:
        manifest = {
            **parts.counters.state_dict(),
            "layout": place.layout(parts.module.param_dtype),
            ckpt_layout.EXCLUDES_FROZEN: bool(exclude_frozen_parameters),
            "skeletons": _manifest_skeletons(skeletons, all_records, merge, rank_state=rank_skeletons[1] is not None),
        }
        merged = {name: rec for _, recs, _, _ in all_records for name, rec in recs.items()}
        ckpt.finalize_checkpoint(
            save_dir, tag, staging, manifest=manifest, file_records=merged, save_latest=save_latest
        )
    writers.barrier(tag=f"checkpoint {tag}: finalized")
    return True


def _write_rank_files(parts: Stateful, place: Placement, staging, skeletons: dict) -> tuple[dict, tuple]:
    """Write the state that is not sharded: the engine state (scheduler, loss scaler, client
    state; global rank 0, its skeleton into ``skeletons``), this rank's RNG and its own
    optimizer state. Returns the file records and ``(rng skeleton, optimizer-rank skeleton)``."""
    files: dict[str, dict[str, torch.Tensor]] = {}
    if place.writers.rank == 0:
        engine_state = {
            "lr_scheduler": parts.lr_scheduler.state_dict() if parts.lr_scheduler is not None else None,
            "loss_scaler": parts.loss_scaler.state_dict() if parts.loss_scaler is not None else None,
            "client_state": parts.client.state_dict(),
            "training_features": parts.features.state_dict() if parts.features is not None else {},
        }
        files[_ENGINE], skeletons["engine_state"] = ckpt.flatten_state(engine_state)
    files[_rng_file(place.global_rank)], rng_skeleton = ckpt.flatten_state(parts.rng.state_dict())
    rank_skeleton = None
    if parts.optimizer is not None and parts.optimizer.has_rank_state:
        files[_optimizer_rank_file(place.global_rank)], rank_skeleton = ckpt.flatten_state(
            parts.optimizer.rank_state_dict()
        )
    return ckpt.write_files(staging, files), (rng_skeleton, rank_skeleton)


def _manifest_skeletons(skeletons: dict, all_records: list, merge: bool, *, rank_state: bool) -> dict:
    """The manifest's skeletons: the stages' (and expert ranks') merged when ``merge``
    (rank 0's first), with every rank's RNG and optimizer-rank skeletons by global rank."""
    if merge:
        skeletons = _merge_stage_skeletons([skel for *_, skel in all_records if skel is not None])
    by_rank = sorted(all_records, key=lambda r: r[0])
    skeletons["rng"] = {str(rank): skel for rank, _, (skel, _), _ in by_rank}
    if rank_state:
        skeletons["optimizer_rank"] = {str(rank): skel for rank, _, (_, skel), _ in by_rank}
    return skeletons


def _check_same_directory(place: Placement, save_dir) -> None:
    """Raise, on every rank, when the ranks were given different ``save_dir`` s (every rank
    writes its part of one checkpoint into the same directory)."""
    given = os.fspath(save_dir)
    every = place.writers.all_gather_object((place.global_rank, given), tag="checkpoint directory check")
    ranks_of: dict[str, list[int]] = {}
    for rank, directory in sorted(every):
        ranks_of.setdefault(directory, []).append(rank)
    if len(ranks_of) == 1:
        return
    shown = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {directory!r}"
        for directory, ranks in list(ranks_of.items())[:8]
    )
    raise ValueError(
        f"save_checkpoint was called with a different directory on each rank ({shown}"
        f"{'; ...' if len(ranks_of) > 8 else ''}). Every rank writes its part of one checkpoint into the "
        "same directory: pass the same save_dir on every rank (a name made from the time differs between "
        "ranks that start a second apart; make the name on one rank and broadcast it, or leave the time out)"
    )


def _check_tag_agrees(writers: Writers, tag: str, mode: str) -> None:
    comms = [c for c in (writers.data, writers.tensor) if c is not None and c.world_size > 1]
    if mode == "Ignore" or not comms:
        return
    digest = int(hashlib.sha1(tag.encode()).hexdigest()[:12], 16)
    agree = True
    for comm in comms:
        low, high = comm.all_reduce_scalars(
            [-digest, digest], op=torch.distributed.ReduceOp.MAX, tag="checkpoint tag check"
        )
        agree = agree and -low == high
    if not agree:
        message = f"checkpoint tag {tag!r} differs between ranks; pass the same tag on every rank"
        if mode == "Fail":
            raise ValueError(message)
        logger.warning(message)


def _remove_stale_staging(save_dir, tag: str) -> None:
    """Clear what killed saves left in ``save_dir`` before a new save begins, naming each
    directory removed or kept (see [Note: stale staging directories] in checkpoint/_write.py)."""
    removed, kept = ckpt.remove_stale_staging(save_dir, current_tag=tag)
    for path in removed:
        logger.info("removed %s, the staging directory of an interrupted save", path)
    for path, reason in kept.items():
        logger.warning("left %s, the staging directory of an unfinished save, in place: %s", path, reason)


def _merge_stage_skeletons(stages: list[dict]) -> dict:
    """One model's skeletons from each stage's (stage order; see [Note: pipeline stages
    in checkpoints]): module entries, aliases and per-parameter optimizer state united,
    each parameter group's names concatenated; everything else is stage 0's."""
    merged = dict(stages[0])
    for what in ("module", "aliases"):
        if what in merged:
            merged[what] = {k: v for skel in stages for k, v in skel[what].items()}
    merged[ckpt_layout.FROZEN_SKELETON] = sorted({k for skel in stages for k in skel[ckpt_layout.FROZEN_SKELETON]})
    if "optimizer" in merged:
        optimizer = dict(merged["optimizer"])
        for what in ("state", "master"):
            optimizer[what] = {k: v for skel in stages for k, v in skel["optimizer"].get(what, {}).items()}
        groups = [dict(g, params=[]) for g in optimizer["param_groups"]]
        for skel in stages:
            if len(skel["optimizer"]["param_groups"]) != len(groups):
                raise NotImplementedError(
                    "pipeline stages have different numbers of optimizer parameter groups; "
                    "a checkpoint needs the same groups on every stage"
                )
            for group, stage_group in zip(groups, skel["optimizer"]["param_groups"]):
                group["params"] += [n for n in stage_group["params"] if n not in group["params"]]
        optimizer["param_groups"] = groups
        merged["optimizer"] = optimizer
    return merged


def _write_optimizer(optimizer: OptimizerState, place: Placement, staging) -> tuple[dict, dict, list[str]]:
    """Write the named optimizer state with no rank gathering it (collective): rank 0
    writes what every rank holds alike (parameter groups, ``step``) to
    ``optimizer.safetensors``; ZeRO shards and the per-element state of tensor-parallel
    parameters go into parts (see [Note: shards written in place]). Returns this rank's
    file records, the state's skeleton and the file names."""
    writers, splits, experts = place.writers, place.splits, place.experts
    records: dict = {}
    named = optimizer.replicated()
    # per-element state of split parameters is a slice; what is left (step counters) is whole
    sliced = [(key, name, tensor, splits[name]) for key, name, tensor in _take_split_state(named, splits)]
    if writers.stages > 1:
        sliced += [(*taken, None) for taken in _take_per_param_state(named)]
    elif experts is not None:
        sliced += [(*taken, None) for taken in _take_per_param_state(named, only=experts.stored)]
    named = _stored_names(named, place)
    tensors, skeleton = ckpt.flatten_state(named)
    if writers.rank == 0:
        records.update(ckpt.write_files(staging, {_OPTIMIZER: tensors}))
    blocks = [_stored_block(block, place) for block in optimizer.blocks()]
    refs = [(block.key, name) for block in blocks for name in block.names]
    refs += [(k, place.store(n)) for k, n, _, _ in sliced]
    for key, name in refs:
        ref = {"__tensor__": block_key(key, name)}
        if key == MASTER_KEY:
            skeleton["master"][name] = ref
        else:
            skeleton["state"].setdefault(name, {})[key] = ref
    groups = block_groups(blocks, optimizer.shards, place.stored_splits)
    groups += [
        whole_group(
            block_key(key, place.store(name)),
            tensor,
            split,
            writers.data.world_size,
            name=name,
            holders=experts.holders.get(name) if experts is not None else None,
        )
        for key, name, tensor, split in sliced
    ]
    groups = without_names(groups, place.tied_elsewhere)
    part_records, parts = write_parts(
        writers, staging, "optimizer", groups, part_bytes=CHECKPOINT_PART_BYTES, across_data=experts is not None
    )
    records.update(part_records)
    return records, skeleton, [_OPTIMIZER] + parts


def _take_split_state(named: dict, splits: dict[str, TensorSplit]) -> list[tuple[str, str, torch.Tensor]]:
    """Remove from the named optimizer state the tensors that are tensor-parallel slices
    (per-element state and masters of split parameters held whole by every data rank,
    i.e. stage 0); returns them as ``(state key or MASTER_KEY, name, tensor)``. The dicts
    are replaced, not changed: they may be the optimizer's own."""
    taken = []
    named["state"] = {name: dict(entry) for name, entry in named["state"].items()}
    named["master"] = dict(named.get("master", {}))
    for name, split in splits.items():
        for key, value in list(named["state"].get(name, {}).items()):
            if not isinstance(value, torch.Tensor) or value.numel() <= 1:
                continue  # step counters: alike on every tensor rank
            if tuple(value.shape) != split.held_shape:
                raise NotImplementedError(
                    f"optimizer state {key!r} of tensor-parallel parameter {name} has shape "
                    f"{list(value.shape)}, not the parameter's {list(split.held_shape)}: a "
                    "checkpoint can store only per-element state of split parameters"
                )
            taken.append((key, name, named["state"][name].pop(key)))
        if name in named.get("master", {}):
            taken.append((MASTER_KEY, name, named["master"].pop(name)))
    return taken


def _take_per_param_state(named: dict, only=None) -> list[tuple[str, str, torch.Tensor]]:
    """Under pipeline parallelism (or for the experts, ``only`` their names): remove every
    tensor left in the named state (the per-parameter state and masters a rank holds
    whole) for the parts, returned as ``_take_split_state`` returns them, since each stage
    (expert rank) holds other parameters' state and only one rank writes
    ``optimizer.safetensors``."""
    taken = []
    named["state"] = {name: dict(entry) for name, entry in named["state"].items()}
    named["master"] = dict(named.get("master", {}))
    for name, entry in named["state"].items():
        for key, value in list(entry.items()):
            if isinstance(value, torch.Tensor) and (only is None or name in only):
                taken.append((key, name, entry.pop(key)))
    for name in list(named["master"]):
        if only is None or name in only:
            taken.append((MASTER_KEY, name, named["master"].pop(name)))
    return taken


def _stored_names(named: dict, place: Placement) -> dict:
    """The named optimizer state under the names the checkpoint stores (experts by global id)."""
    if place.experts is None:
        return named
    store = place.store
    return {
        **named,
        "state": {store(n): v for n, v in named["state"].items()},
        "master": {store(n): v for n, v in named.get("master", {}).items()},
        "param_groups": [dict(g, params=[store(n) for n in g["params"]]) for g in named["param_groups"]],
    }


def _stored_block(block, place: Placement):
    """``block`` with its parameters' stored names."""
    if place.experts is None:
        return block
    return dataclasses.replace(block, names=tuple(place.store(n) for n in block.names))


def _write_module(
    module: ModuleState, place: Placement, staging, *, left_out: frozenset[str]
) -> tuple[dict, dict, list[str]]:
    """Write the module's state dict the same way: entries every rank holds alike (buffers,
    parameters outside ZeRO buckets) by rank 0 in ``model.safetensors``, the bucketed and
    tensor-parallel parameters by every rank into ``model-00001.safetensors``... under
    their own names (tied names refer to one tensor), the parameters ``left_out`` (by
    name) not at all. Collective."""
    writers, splits, name_of, experts = place.writers, place.splits, place.name_of_key, place.experts
    replicated = {k: v for k, v in module.replicated().items() if name_of.get(k) not in left_out}
    piped = writers.stages > 1  # every stage's tensors go to the parts

    def to_parts(key: str) -> bool:  # see [Note: experts in checkpoints]
        return piped or name_of.get(key) in splits or (experts is not None and key in experts.stored)

    sliced = {name_of.get(k, k): v for k, v in replicated.items() if to_parts(k)}
    plain = {k: v for k, v in replicated.items() if not to_parts(k)}
    tensors, flat_skeleton = ckpt.flatten_state(plain)
    records: dict = {}
    if writers.rank == 0:
        records.update(ckpt.write_files(staging, {_MODEL: tensors}))
    skeleton = {
        place.store(key): flat_skeleton[key] if key in plain else {"__tensor__": place.store(name_of.get(key, key))}
        for key in place.keys
        if name_of.get(key) not in left_out
    }
    groups = block_groups([_stored_block(b, place) for b in module.blocks()], module.shards, place.stored_splits)
    groups += [
        whole_group(
            place.store(name),
            tensor,
            splits.get(name),
            writers.data.world_size,
            holders=experts.holders.get(name) if experts is not None else None,
        )
        for name, tensor in sliced.items()
    ]
    groups = without_names(groups, place.tied_elsewhere | {place.store(name) for name in left_out})
    part_records, parts = write_parts(
        writers, staging, "model", groups, part_bytes=CHECKPOINT_PART_BYTES, across_data=experts is not None
    )
    records.update(part_records)
    return records, skeleton, [_MODEL] + parts


def load(
    parts: Stateful,
    place: Placement,
    load_dir,
    *,
    tag,
    strict: bool,
    load_optimizer: bool,
    load_scheduler: bool,
    module_only: bool,
):
    """Restore ``parts`` from a checkpoint, this rank reading what ``place`` says it holds;
    returns ``(path, client_state)``.

    Like DeepSpeed, asking for the latest checkpoint of a directory that has none is not
    an error: a warning is logged and ``(None, None)`` returned, so "resume if possible"
    scripts work. Anything wrong with a checkpoint that does exist raises CheckpointError;
    what is read is checked against this model and layout before anything is loaded.
    """
    path = _resolve(load_dir, tag)
    if path is None:
        return None, None
    manifest = ckpt.read_manifest(path)
    load_optimizer = load_optimizer and not module_only and parts.optimizer is not None
    if load_optimizer and "optimizer" not in manifest["skeletons"]:
        raise CheckpointError(
            f"{path} holds no optimizer state (it was saved without an optimizer); load "
            "with load_optimizer_states=False"
        )
    where = f"checkpoint {path} (saved at {_saved_layout(manifest)})"
    excluded = frozen.excluded_keys(manifest, place)
    frozen.check_excluded(excluded, place, strict=strict, where=where)
    module_state = _read_module_state(path, manifest, place, where=where)
    saved_optimizer = _read_optimizer_state(path, manifest, place, where=where) if load_optimizer else None
    engine_state = ckpt.unflatten_state(
        ckpt.read_tensors(path, _ENGINE, manifest=manifest), manifest["skeletons"]["engine_state"]
    )
    frozen.load_module(parts.module, module_state, strict=strict, excluded=excluded)
    del module_state
    parts.client.load_state_dict(engine_state["client_state"])
    if not module_only:
        if saved_optimizer is not None:
            parts.optimizer.load_state_dict(saved_optimizer)
            del saved_optimizer
            _load_optimizer_rank_state(parts.optimizer, path, manifest, place.global_rank)
        _load_engine_state(parts, engine_state, load_scheduler=load_scheduler)
        _load_counters(parts, manifest)
        _load_rng(parts, path, manifest, place.global_rank)
    return str(path), parts.client.state_dict()


def _resolve(load_dir, tag) -> Path | None:
    """The checkpoint directory to load; None (with a warning) for no ``latest`` file."""
    if tag is None and not (Path(load_dir) / "latest").is_file():
        logger.warning(
            "no 'latest' file in %s: nothing to resume from, starting fresh (pass tag= to load a specific checkpoint)",
            load_dir,
        )
        return None
    return Path(load_dir) / ckpt.resolve_tag(load_dir, tag)


def _read_module_state(path: Path, manifest: dict, place: Placement, *, where: str) -> dict:
    """The module state this rank loads: its stage's keys, its tensor-parallel slices
    (mapped, not read: each rank copies out only its slices and shards)."""
    state = ckpt_layout.read_module_state(path, manifest, mmap=True)
    return _module_to_layout(place.stage_module_state(state), place, where=where)


def _read_optimizer_state(path: Path, manifest: dict, place: Placement, *, where: str) -> dict:
    """The named optimizer state this rank loads: its stage's parameters', sliced."""
    saved = ckpt_layout.read_optimizer_state(path, manifest, mmap=True)
    return _optimizer_to_layout(place.stage_optimizer_state(saved), place, where=where)


def _load_optimizer_rank_state(optimizer: OptimizerState, path: Path, manifest: dict, rank: int) -> None:
    """Give the optimizer back this rank's own state (``optimizer_rank<R>``), or an empty
    dict when the checkpoint has none for this rank or comes from another data-parallel
    world size (the optimizer starts that state afresh and says so)."""
    if not optimizer.takes_rank_state:
        return
    name = _optimizer_rank_file(rank)
    skeleton = manifest["skeletons"].get("optimizer_rank", {}).get(str(rank))
    if skeleton is None or name not in manifest.get("files", {}):
        optimizer.load_rank_state_dict({})
    else:  # the state names the world size it belongs to; the optimizer checks it
        optimizer.load_rank_state_dict(ckpt.unflatten_state(ckpt.read_tensors(path, name, manifest=manifest), skeleton))


def _load_engine_state(parts: Stateful, engine_state: dict, *, load_scheduler: bool) -> None:
    """The scheduler (unless ``load_scheduler`` is False) and the loss scaler, where both
    the engine and the checkpoint have one, and the training features' state."""
    if load_scheduler and parts.lr_scheduler is not None and engine_state["lr_scheduler"] is not None:
        parts.lr_scheduler.load_state_dict(engine_state["lr_scheduler"])
    if parts.loss_scaler is not None and engine_state["loss_scaler"] is not None:
        parts.loss_scaler.load_state_dict(engine_state["loss_scaler"])
    if parts.features is not None:  # checkpoints from before training features have none
        parts.features.load_state_dict(engine_state.get("training_features", {}))


def _load_counters(parts: Stateful, manifest: dict) -> None:
    """The saved counters, but the accumulation window restarts at a step boundary,
    whatever the saved layout's accumulation steps were (a different world size changes
    them)."""
    saved = {name: manifest[name] for name in parts.counters.state_dict()}
    parts.counters.load_state_dict({**saved, "micro_steps": saved["global_steps"] * parts.accumulation_steps})


def _load_rng(parts: Stateful, path: Path, manifest: dict, rank: int) -> None:
    name = _rng_file(rank)
    if name not in manifest.get("files", {}):
        logger.warning(
            "checkpoint %s has no RNG state for rank %d (saved at %s); random streams start fresh",
            path,
            rank,
            _saved_layout(manifest),
        )
        return
    parts.rng.load_state_dict(
        ckpt.unflatten_state(ckpt.read_tensors(path, name, manifest=manifest), manifest["skeletons"]["rng"][str(rank)])
    )


def _saved_layout(manifest: dict) -> str:
    layout = manifest.get("layout", {})
    pipe = layout.get("pp_degree", 1)
    return (
        f"ZeRO stage {layout.get('zero_stage', '?')}, data {layout.get('dp_world_size', '?')} x tensor "
        f"{layout.get('tp_degree', 1)}" + (f" x pipe {pipe}" if pipe > 1 else "")
    )


def _module_to_layout(state: dict, place: Placement, *, where: str) -> dict:
    """``state`` (full tensors by state-dict key) with each tensor-parallel parameter's
    value cut to this rank's slice (a view where the slice is one); every tensor the model
    holds is checked against its full shape first (see [Note: tensor parallelism in
    checkpoints])."""
    by_key = place.split_by_key
    out, problems = dict(state), []
    for key, (_, expected) in place.keys.items():
        if key not in state:
            continue
        split = by_key.get(key)
        if tuple(state[key].shape) != expected:
            problems.append(_mismatch(key, state[key], expected, split))
        elif split is not None:
            out[key] = split.slice_of(state[key])
    _raise_mismatches(place, problems, where)
    return out


def _optimizer_to_layout(saved: dict, place: Placement, *, where: str) -> dict:
    """The named optimizer state with each tensor-parallel parameter's per-element state
    and master cut to this rank's slice, shapes checked first."""
    if not place.splits:
        return saved
    state = {name: dict(entry) for name, entry in saved["state"].items()}
    master = dict(saved.get("master", {}))
    problems = []
    for name, split in place.splits.items():
        values = [(state[name], key) for key in state.get(name, {})] + ([(master, name)] if name in master else [])
        for holder, key in values:
            value = holder[key]
            if not isinstance(value, torch.Tensor) or value.numel() <= 1:
                continue
            if tuple(value.shape) != split.stored_shape:
                problems.append(
                    _mismatch(
                        f"{name} (optimizer state {key!r})" if holder is not master else f"{name} (fp32 master)",
                        value,
                        split.stored_shape,
                        split,
                    )
                )
            else:
                holder[key] = split.slice_of(value)
    _raise_mismatches(place, problems, where)
    return {**saved, "state": state, "master": master}


def _mismatch(what: str, value: torch.Tensor, expected, split: TensorSplit | None) -> str:
    held = f"; this rank holds {split.describe()}" if split is not None else ""
    return f"{what}: stored {list(value.shape)}, this model's full tensor is {list(expected)}{held}"


def _raise_mismatches(place: Placement, problems: list[str], where: str) -> None:
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(
            f"{where} does not fit this model at {place.describe()}: {shown}. A checkpoint stores full tensors, "
            "so any ZeRO stage and data x tensor layout loads it, but the model must have the same sizes; nothing "
            "was loaded"
        )


def module_state_for_layout(state: dict, place: Placement) -> dict:
    """A full state dict (``load_module_state_dict``'s) cut to this rank's stage and
    tensor-parallel slices, shapes checked as a checkpoint load checks them."""
    state = place.stage_module_state(state)
    if not place.splits:
        return state
    return _module_to_layout(state, place, where="the state dict given to load_module_state_dict")
