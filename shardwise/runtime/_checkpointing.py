"""What the engine saves and restores; the file format itself lives in shardwise.checkpoint.

Layout of one checkpoint directory (every tensor is stored under a parameter name, never
a rank or an optimizer index, so any later layout can read it):
- ``model.safetensors``: the module's state_dict; at ZeRO stages 1-3 the parameters are
  in ``model-00001.safetensors`` and on, each rank writing its shards into place.
- ``optimizer.safetensors``: optimizer state per parameter name, plus fp32 master
  weights when the module trains in fp16/bf16. The per-element tensors of sharded stages
  are in ``optimizer-00001.safetensors`` and on, each rank writing its shards into place
  (see [Note: shards written in place]).
- ``engine_state.safetensors``: tensors of the LR scheduler, loss scaler and client state.
- ``rng_rank<R>.safetensors``: each rank's random number generator states.
- ``manifest.json``: counters, layout, and the structure (skeleton) of each state above.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from shardwise import checkpoint as ckpt
from shardwise.checkpoint import layout as ckpt_layout
from shardwise.zero._strategy import MASTER_KEY, PARAM_KEY, ShardBlock

logger = logging.getLogger("shardwise")

_MODEL, _OPTIMIZER, _ENGINE = ckpt_layout.MODEL_FILE, ckpt_layout.OPTIMIZER_FILE, ckpt_layout.ENGINE_FILE
_rng_file = ckpt_layout.rng_file

CHECKPOINT_PART_BYTES = 1 << 30
"""Bytes of sharded tensors per part file (see [Note: shards written in place])."""


def _aliases(module) -> dict[str, str]:
    """State-dict keys that name a tensor already saved under an earlier key (tied weights)."""
    first: dict[int, str] = {}
    aliases = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases[key] = first[id(tensor)]
        else:
            first[id(tensor)] = key
    return aliases


def _refuse_model_parallel(engine, what: str) -> None:
    """Checkpoints name each tensor once with its full shape; a layout that splits one
    parameter across tensor ranks or stages is not written that way yet: refuse it
    rather than let tensor ranks write different slices under one name."""
    grid = engine.grid
    if grid.tensor > 1 or grid.pipe > 1:
        raise NotImplementedError(f"{what} with tensor or pipeline parallelism (grid pipe {grid.pipe} x data "
                                  f"{grid.data} x tensor {grid.tensor}) is not available in this version of "
                                  "shardwise yet; save the module with engine.module_state_dict() on each tensor "
                                  "rank in the meantime")


def _check_tag_agrees(engine, tag: str) -> None:
    mode = engine.train_config.checkpoint.tag_validation
    if mode == "Ignore" or engine.comm.world_size == 1:
        return
    digest = int(hashlib.sha1(tag.encode()).hexdigest()[:12], 16)
    low, high = engine.comm.all_reduce_scalars([-digest, digest], op=torch.distributed.ReduceOp.MAX,
                                               tag="checkpoint tag check")
    if -low != high:
        message = f"checkpoint tag {tag!r} differs between ranks; pass the same tag on every rank"
        if mode == "Fail":
            raise ValueError(message)
        logger.warning(message)


def save(engine, save_dir, *, tag, client_state: dict, save_latest: bool) -> bool:
    """Write a checkpoint of ``engine`` (collective: every rank calls it)."""
    _refuse_model_parallel(engine, "save_checkpoint")
    comm = engine.comm
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    _check_tag_agrees(engine, tag)
    if comm.rank == 0:
        _remove_stale_staging(save_dir, tag)
    staging = ckpt.begin_checkpoint(save_dir, tag, clean=comm.rank == 0)
    comm.barrier(tag=f"checkpoint {tag}: staging created")
    files: dict[str, dict[str, torch.Tensor]] = {}
    skeletons: dict = {}
    # collective for sharded stages: every rank takes part, rank 0 writes
    records = {}
    if engine.optimizer is not None:
        records, skeletons["optimizer"], skeletons["optimizer_files"] = _write_optimizer(engine, staging)
    module_records, skeletons["module"], skeletons["module_files"] = _write_module(engine, staging)
    records.update(module_records)
    if comm.rank == 0:
        skeletons["aliases"] = _aliases(engine.module)
        engine_state = {
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
            "client_state": client_state,
        }
        files[_ENGINE], skeletons["engine_state"] = ckpt.flatten_state(engine_state)
    rng_tensors, rng_skeleton = ckpt.flatten_state(ckpt.capture_rng_state())
    files[_rng_file(comm.rank)] = rng_tensors
    records.update(ckpt.write_files(staging, files))
    all_records = comm.all_gather_object((records, rng_skeleton))
    if comm.rank == 0:
        merged = {name: rec for recs, _ in all_records for name, rec in recs.items()}
        skeletons["rng"] = {str(rank): skel for rank, (_, skel) in enumerate(all_records)}
        manifest = {
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
            "layout": {"zero_stage": engine.train_config.zero.stage, "dp_world_size": comm.world_size,
                       "param_dtype": str(engine.policy.param_dtype).removeprefix("torch.")},
            "skeletons": skeletons,
        }
        ckpt.finalize_checkpoint(save_dir, tag, staging, manifest=manifest, file_records=merged,
                                 save_latest=save_latest)
    comm.barrier(tag=f"checkpoint {tag}: finalized")
    return True


def _remove_stale_staging(save_dir, tag: str) -> None:
    """Clear what killed saves left in ``save_dir`` before a new save begins, naming each
    directory removed or kept (see [Note: stale staging directories] in checkpoint/_write.py)."""
    removed, kept = ckpt.remove_stale_staging(save_dir, current_tag=tag)
    for path in removed:
        logger.info("removed %s, the staging directory of an interrupted save", path)
    for path, reason in kept.items():
        logger.warning("left %s, the staging directory of an unfinished save, in place: %s", path, reason)


def _write_optimizer(engine, staging) -> tuple[dict, dict, list[str]]:
    """Write the named optimizer state with no rank gathering it (collective): rank 0
    writes what every rank holds alike (parameter groups, ``step``) to
    ``optimizer.safetensors``, the shards go into parts (see [Note: shards written in
    place]). Returns this rank's file records, the state's skeleton and the file names."""
    comm, strategy = engine.comm, engine.strategy
    records: dict = {}
    tensors, skeleton = ckpt.flatten_state(strategy.optimizer_state_replicated())
    if comm.rank == 0:
        records.update(ckpt.write_files(staging, {_OPTIMIZER: tensors}))
    blocks = strategy.optimizer_state_blocks()
    for block in blocks:
        for name in block.names:
            ref = {"__tensor__": _block_key(block.key, name)}
            if block.key == MASTER_KEY:
                skeleton["master"][name] = ref
            else:
                skeleton["state"].setdefault(name, {})[block.key] = ref
    part_records, parts = _write_blocks(comm, staging, "optimizer", blocks, strategy.optimizer_shards)
    records.update(part_records)
    return records, skeleton, [_OPTIMIZER] + parts


def _write_module(engine, staging) -> tuple[dict, dict, list[str]]:
    """Write the module's state dict the same way: entries every rank holds alike (buffers,
    parameters outside ZeRO buckets) by rank 0 in ``model.safetensors``, the bucketed
    parameters by every rank into ``model-00001.safetensors``... under their own names
    (tied names refer to one tensor). Collective."""
    comm, strategy = engine.comm, engine.strategy
    replicated = strategy.module_state_replicated()
    tensors, flat_skeleton = ckpt.flatten_state(replicated)
    records: dict = {}
    if comm.rank == 0:
        records.update(ckpt.write_files(staging, {_MODEL: tensors}))
    blocks = strategy.module_state_blocks()
    name_of = {id(p): name for name, p in engine.module.named_parameters()}
    skeleton = {}
    for key, tensor in engine.module.state_dict(keep_vars=True).items():
        skeleton[key] = flat_skeleton[key] if key in replicated else {"__tensor__": name_of[id(tensor)]}
    part_records, parts = _write_blocks(comm, staging, "model", blocks, strategy.module_shards)
    records.update(part_records)
    return records, skeleton, [_MODEL] + parts


def _write_blocks(comm, staging, stem: str, blocks: list[ShardBlock], open_shards) -> tuple[dict, list[str]]:
    """Write sharded tensors into part files with no rank gathering them (collective).

    [Note: shards written in place]
    The blocks are laid out in ``<stem>-00001.safetensors`` and on, about
    ``CHECKPOINT_PART_BYTES`` each: a block is a bucket's parameters' full tensors back to
    back, then its padding, so each rank's shard of the bucket is one contiguous byte
    range. Rank 0 creates the files with their headers; every rank computes the same
    offsets (``tensor_file_layout`` is a pure function) and writes its shards into place a
    bucket at a time (``open_shards(bucket)`` holds just that bucket in memory: with nvme
    offload, only it is swapped in), rank ``r`` starting ``r/N`` of the way through the
    buckets so that ranks mostly write different files at once (writers of one file queue
    on its lock); rank ``k % N`` then hashes part ``k``. The parts are
    ordinary safetensors files whose tensors are named like any other, so loading needs no
    knowledge of the world size that wrote them.

    Returns this rank's file records and the part names.
    """
    parts: list[list[ShardBlock]] = []
    size = CHECKPOINT_PART_BYTES
    for block in blocks:
        nbytes = block.padded * torch.empty(0, dtype=block.dtype).element_size()
        if size + nbytes > CHECKPOINT_PART_BYTES and size > 0:
            parts.append([])
            size = 0
        parts[-1].append(block)
        size += nbytes
    names = [f"{stem}-{k + 1:05d}.safetensors" for k in range(len(parts))]
    starts: dict[tuple[int, str], tuple[str, int]] = {}  # (bucket, key) -> (file, byte offset of its block)
    for name, part in zip(names, parts):
        entries = [entry for block in part for entry in _block_entries(block)]
        offsets = ckpt.create_tensor_file(staging / name, entries) if comm.rank == 0 \
            else ckpt.tensor_file_layout(entries)[1]
        for block in part:
            starts[(block.bucket, block.key)] = (name, offsets[_block_entries(block)[0][0]])
    comm.barrier(tag=f"{stem} checkpoint files created")
    by_bucket: dict[int, list[ShardBlock]] = {}
    for block in blocks:
        by_bucket.setdefault(block.bucket, []).append(block)
    order = list(by_bucket)
    start = len(order) * comm.rank // comm.world_size  # ranks start apart: mostly different files at once
    for bucket in order[start:] + order[:start]:
        bucket_blocks = by_bucket[bucket]
        with open_shards(bucket) as shards:
            for block in bucket_blocks:
                name, start = starts[(bucket, block.key)]
                shard = shards[block.key]
                ckpt.write_into(staging / name, start + comm.rank * block.shard * shard.element_size(), shard)
    comm.barrier(tag=f"{stem} shards written")
    return {name: ckpt.seal_tensor_file(staging / name)
            for k, name in enumerate(names) if k % comm.world_size == comm.rank}, names


def _block_key(key: str, name: str) -> str:
    """The tensor key of parameter ``name``'s slice of a block: its own name for module
    parameters; '/' (never in the dotted keys ``flatten_state`` makes) for optimizer state."""
    if key == PARAM_KEY:
        return name
    return f"master/{name}" if key == MASTER_KEY else f"state/{name}/{key}"


def _block_entries(block: ShardBlock) -> list[tuple[str, torch.dtype, list[int]]]:
    entries = [(_block_key(block.key, name), block.dtype, list(shape))
               for name, shape in zip(block.names, block.shapes)]
    padding = block.padded - sum(shape.numel() for shape in block.shapes)
    entries.append((f"padding/{block.bucket}/{block.key}", block.dtype, [padding]))
    return entries


def load(engine, load_dir, *, tag, strict: bool, load_optimizer: bool, load_scheduler: bool,
         module_only: bool):
    """Restore ``engine`` from a checkpoint; returns ``(path, client_state)``.

    Like DeepSpeed, asking for the latest checkpoint of a directory that has none is not
    an error: a warning is logged and ``(None, None)`` returned, so "resume if possible"
    scripts work. Anything wrong with a checkpoint that does exist raises CheckpointError.
    """
    _refuse_model_parallel(engine, "load_checkpoint")
    if tag is None and not (Path(load_dir) / "latest").is_file():
        logger.warning("no 'latest' file in %s: nothing to resume from, starting fresh "
                       "(pass tag= to load a specific checkpoint)", load_dir)
        return None, None
    tag = ckpt.resolve_tag(load_dir, tag)
    path = Path(load_dir) / tag
    manifest = ckpt.read_manifest(path)
    skeletons = manifest["skeletons"]
    module_state = ckpt_layout.read_module_state(path, manifest, mmap=True)  # copied into the parameters
    result = engine.strategy.load_module_state_dict(module_state, strict=strict)
    del module_state
    if not strict and (result.missing_keys or result.unexpected_keys):
        logger.warning("checkpoint loaded non-strictly: missing %s, unexpected %s",
                       result.missing_keys, result.unexpected_keys)
    engine_state = ckpt.unflatten_state(ckpt.read_tensors(path, _ENGINE, manifest=manifest),
                                        skeletons["engine_state"])
    if module_only:
        return str(path), engine_state["client_state"]
    if load_optimizer and engine.optimizer is not None:
        if "optimizer" not in skeletons:
            raise ckpt.CheckpointError(f"{path} holds no optimizer state (it was saved without an "
                                       "optimizer); load with load_optimizer_states=False")
        # mapped, not read: each rank copies out only its shards
        saved = ckpt_layout.read_optimizer_state(path, manifest, mmap=True)
        engine.strategy.load_optimizer_state_by_name(saved)
        del saved
    if load_scheduler and engine.lr_scheduler is not None and engine_state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(engine_state["lr_scheduler"])
    if engine.loss_scaler is not None and engine_state["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(engine_state["loss_scaler"])
    engine.global_steps = manifest["global_steps"]
    engine.global_samples = manifest["global_samples"]
    # the accumulation window restarts at a step boundary, whatever the saved layout's
    # accumulation steps were (a different world size changes them)
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    engine.skipped_steps = manifest["skipped_steps"]
    rng_name = _rng_file(engine.comm.rank)
    if rng_name in manifest.get("files", {}):
        rng = ckpt.unflatten_state(ckpt.read_tensors(path, rng_name, manifest=manifest),
                                   skeletons["rng"][str(engine.comm.rank)])
        ckpt.restore_rng_state(rng)
    else:
        logger.warning("checkpoint %s has no RNG state for rank %d (saved with %d ranks); "
                       "random streams start fresh", path, engine.comm.rank,
                       manifest["layout"]["dp_world_size"])
    return str(path), engine_state["client_state"]


def save_16bit_model(engine, save_dir, save_filename: str) -> bool:
    """Write the module's state_dict (in its training dtype) to one file on rank 0.

    ``.safetensors`` names get a safetensors file, written a piece at a time (at stage 3
    a unit at a time: only one unit is ever gathered); anything else (DeepSpeed's default
    ``pytorch_model.bin``) a ``torch.save`` file, which is what Hugging Face loaders read
    and which needs the whole state on rank 0. Collective: every rank calls it.
    """
    _refuse_model_parallel(engine, "save_16bit_model")
    comm, strategy = engine.comm, engine.strategy
    path = Path(save_dir) / save_filename
    tmp = path.with_name(f".{path.name}.tmp")
    writer = comm.rank == 0
    if writer:
        path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        current = engine.module.state_dict(keep_vars=True)
        entries = [(k, v.dtype, list(getattr(v, "ds_shape", v.shape))) for k, v in current.items()]
        prefix, offsets, _ = ckpt.tensor_file_layout(entries)
        if writer:
            with open(tmp, "wb") as handle:
                handle.write(prefix)
        for piece in strategy.module_state_pieces():
            if writer:
                for key, tensor in piece.items():
                    ckpt.write_into(tmp, offsets[key], tensor)
    else:
        state = {}
        for piece in strategy.module_state_pieces():
            if writer:
                state.update({k: v.detach().cpu().clone() for k, v in piece.items()})
        if writer:
            torch.save(state, tmp)
    if writer:
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        tmp.replace(path)
    comm.barrier(tag="save_16bit_model")
    return True
