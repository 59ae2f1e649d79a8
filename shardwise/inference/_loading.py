"""Fill a model for inference from a checkpoint, each rank reading only its slices.

[Note: loading slices]
``init_inference`` splits the model over the tensor group before it loads anything (see
[Note: inference setup order] in ``engine.py``), so every parameter already knows which
part of the full tensor it holds: a replicated one holds all of it, a split one carries
``shard_info`` (full shape, dim, index, parts), ``partition_stride`` (the number of
stacked blocks, each split on its own: GPT-2's q|k|v) and ``tensor_parallel_transposed``
(GPT-2's ``Conv1D`` tensors are stored ``[in, out]``, the split layers hold ``[out, in]``;
see [Note: stacked and transposed weights] in ``tensor_parallel/autotp.py``). Loading is
then one pass over the model's tensors by name:

1. the checkpoint is opened as a table ``name -> stored tensor`` without reading any
   values: safetensors files through ``safe_open`` (shapes from the header), PyTorch
   files through ``torch.load(mmap=True, weights_only=True)`` (values stay on disk until
   touched), a shardwise training checkpoint through its manifest;
2. each model tensor is matched to a stored name (its own, a ``module.`` or base-model
   prefix variant, the name ``transformers`` renames it from, or, for a tied LM head,
   the input embedding's) and the stored shape is checked against the full shape, all
   before anything is read;
3. a split tensor reads, per block, the rows or columns of its index along the split dim
   in the stored layout (``get_slice(name)[..., a:b]``, or ``narrow`` of the mapped
   tensor), concatenates the blocks and transposes back; a replicated one reads whole.
   So a rank reads about ``replicated + split / tp`` elements, never the full model;
4. a meta tensor is replaced by the values read (floating point cast to ``dtype``,
   tensor-parallel marks kept, ``requires_grad`` False; a tensor shared under several
   names stays shared); a real tensor is overwritten in place;
5. non-persistent buffers still on meta (rotary ``inv_freq``, which no checkpoint
   holds) are rebuilt by constructing their module again on the CPU from its config.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from shardwise.tensor_parallel._partition import copy_marks, shard_info

logger = logging.getLogger("shardwise")

_TORCH_SUFFIXES = (".bin", ".pt", ".pth")
_NOT_WEIGHTS = {"training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth"}
"""Files of a Hugging Face Trainer checkpoint next to the weights."""
_SHOWN = 5


class _Stored(NamedTuple):
    """One tensor of the checkpoint, not yet read."""

    shape: tuple[int, ...]
    file: str
    read: Callable[[int | None, list[tuple[int, int]]], torch.Tensor]
    """``read(dim, spans)``: the spans ``[a, b)`` along ``dim`` concatenated, or with
    ``dim`` None the whole tensor; always a copy owned by the caller."""


class _Slot(NamedTuple):
    """One model tensor and every ``(module, attribute)`` place that holds it."""

    tensor: torch.Tensor
    names: list[str]
    places: list[tuple[nn.Module, str]]
    is_param: bool


def load_checkpoint(model: nn.Module, checkpoint, *, base_dir: str = "", dtype: torch.dtype | None = None) -> None:
    """Fill every parameter and persistent buffer of ``model`` from ``checkpoint``, reading
    only this rank's slice of each tensor-parallel tensor (see [Note: loading slices]).

    Args:
        model: the model, possibly built on the meta device and already split by
            ``init_inference``.
        checkpoint: a safetensors or ``.bin``/``.pt`` file or directory (Hugging Face
            layout, sharded or not), a shardwise training checkpoint directory, or
            DeepSpeed's checkpoint JSON ``{"type", "checkpoints": [files], "version"}``
            (a dict or a ``.json`` path).
        base_dir: the directory the JSON's file names are relative to; "" means the
            JSON file's directory (the working directory for a dict).
        dtype: floating-point dtype of the tensors that replace meta ones; None keeps
            the meta tensor's dtype.

    Raises:
        ValueError: the checkpoint is missing, unreadable or lacks files it names; a
            stored shape differs from the model's; a parameter is not in it; or a
            tensor is still on the meta device after loading.
    """
    stored = _with_hf_renames(model, _open(checkpoint, base_dir))
    plan = _plan(model, stored, checkpoint)
    elements = 0
    for slot, key in plan:
        value = _read_slot(slot, stored[key])
        elements += value.numel()
        _place(slot, value, dtype)
    _rebuild_meta_buffers(model)
    _check_no_meta(model, checkpoint)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        logger.info(
            "init_inference: loaded %d tensors (%.1fM elements read by rank 0) from %s",
            len(plan),
            elements / 1e6,
            _describe(checkpoint),
        )


# -- opening a checkpoint: name -> _Stored, nothing read yet ---------------------------


def _open(checkpoint, base_dir: str) -> dict[str, _Stored]:
    if isinstance(checkpoint, dict):
        return _open_json(checkpoint, Path(base_dir or "."), "the checkpoint dict")
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be a path or DeepSpeed's checkpoint dict, got {type(checkpoint).__name__}")
    path = Path(checkpoint)
    if not path.exists():
        raise ValueError(f"checkpoint {str(path)!r} does not exist; check the path given as checkpoint=")
    if path.is_dir():
        return _open_dir(path)
    if path.suffix == ".json":
        return _open_json_file(path, base_dir)
    return _open_files([path])


def _open_json_file(path: Path, base_dir: str) -> dict[str, _Stored]:
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"checkpoint JSON {path} cannot be read ({exc}); give a valid JSON file") from None
    if isinstance(spec, dict) and "weight_map" in spec:  # a Hugging Face index file
        return _open_index(path)
    return _open_json(spec, Path(base_dir) if base_dir else path.parent, str(path))


def _open_json(spec, root: Path, what: str) -> dict[str, _Stored]:
    """DeepSpeed's ``{"type", "checkpoints": [...], "version"}``, names relative to ``root``."""
    files = spec.get("checkpoints") if isinstance(spec, dict) else None
    if isinstance(files, dict):
        raise ValueError(
            f"{what}: 'checkpoints' is a dict ({sorted(files)}), DeepSpeed's pre-split tensor-parallel "
            'form; give the full checkpoint files as a list ({"checkpoints": ["model.safetensors"]}): '
            "each rank reads its own slices of them"
        )
    if isinstance(files, str):
        files = [files]
    if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
        raise ValueError(
            f'{what} must be DeepSpeed\'s checkpoint JSON {{"type": "ds_model", "checkpoints": '
            f"[file names], \"version\": 1.0}}; its 'checkpoints' is {files!r}"
        )
    paths = [root / f for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(
            f"{what} names {len(missing)} file(s) that do not exist: {', '.join(missing[:_SHOWN])}"
            f"{'...' if len(missing) > _SHOWN else ''}; the names are relative to base_dir "
            f"({str(root)!r}); set base_dir= to the directory holding them"
        )
    return _open_files(paths)


def _open_dir(path: Path) -> dict[str, _Stored]:
    if (path / "manifest.json").is_file() or (path / "latest").is_file():
        return _open_shardwise(path)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            return _open_index(path / index)
    for pattern in ("*.safetensors", *(f"*{s}" for s in _TORCH_SUFFIXES)):
        found = sorted(p for p in path.glob(pattern) if p.name not in _NOT_WEIGHTS)
        if found:
            return _open_files(found)
    if any((p / "manifest.json").is_file() for p in path.iterdir() if p.is_dir()):
        return _open_shardwise(path)
    names = sorted(p.name for p in path.iterdir())[:10]
    raise ValueError(
        f"checkpoint directory {path} holds no checkpoint shardwise can read ({names}); give a "
        "directory of .safetensors or .bin files, a shardwise checkpoint (with 'latest' or "
        "manifest.json), or a checkpoint JSON"
    )


def _open_index(index: Path) -> dict[str, _Stored]:
    """A Hugging Face sharded checkpoint: the files its ``weight_map`` names."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"checkpoint index {index} cannot be read ({exc!r}); re-save the checkpoint") from None
    paths = [index.parent / name for name in sorted(set(weight_map.values()))]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ValueError(
            f"checkpoint index {index} names {len(missing)} file(s) missing from {index.parent}: "
            f"{', '.join(missing[:_SHOWN])}{'...' if len(missing) > _SHOWN else ''}; copy them there"
        )
    return _open_files(paths)


def _open_files(paths: list[Path]) -> dict[str, _Stored]:
    stored: dict[str, _Stored] = {}
    for path in paths:
        entries = _open_safetensors(path) if path.suffix == ".safetensors" else _open_torch(path)
        twice = sorted(set(entries) & set(stored))
        if twice:
            raise ValueError(
                f"{path} and {stored[twice[0]].file} both hold {twice[:_SHOWN]}: the files are slices "
                "of one model (a Megatron or tensor-parallel split?); give the full checkpoint files"
            )
        stored.update(entries)
    return stored


def _open_safetensors(path: Path, keys: dict[str, str] | None = None) -> dict[str, _Stored]:
    """The tensors of a safetensors file; ``keys`` maps model names to the file's keys
    (those the file lacks are skipped; default: every key under its own name)."""
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
        held = set(handle.keys())
        keys = {k: k for k in held} if keys is None else {n: k for n, k in keys.items() if k in held}
        shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in set(keys.values())}
    except (OSError, SafetensorError) as exc:
        raise ValueError(
            f"checkpoint file {path} cannot be read as safetensors ({exc}); it is missing, damaged or "
            "not a safetensors file; re-save or re-download it"
        ) from None
    return {
        name: _Stored(shapes[key], str(path), functools.partial(_read_safetensors, handle, key))
        for name, key in keys.items()
    }


def _read_safetensors(handle, key: str, dim: int | None, spans: list[tuple[int, int]]) -> torch.Tensor:
    if dim is None:
        return handle.get_tensor(key)
    sliced = handle.get_slice(key)
    lead = (slice(None),) * dim
    return torch.cat([sliced[lead + (slice(a, b),)] for a, b in spans], dim=dim)


def _open_torch(path: Path) -> dict[str, _Stored]:
    if path.suffix not in _TORCH_SUFFIXES:
        raise ValueError(
            f"checkpoint file {path} is neither .safetensors nor a PyTorch file ({_TORCH_SUFFIXES}); "
            "give one of those, a checkpoint directory or a checkpoint JSON"
        )
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
        raise ValueError(
            f"checkpoint file {path} cannot be read with torch.load(weights_only=True) ({exc}); save "
            "the model's state_dict alone (tensors only) with torch.save, or as safetensors"
        ) from None
    if isinstance(state, dict) and not any(isinstance(v, torch.Tensor) for v in state.values()):
        state = next((state[k] for k in ("module", "state_dict", "model") if isinstance(state.get(k), dict)), state)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"checkpoint file {path} does not hold a state dict of tensors; save model.state_dict()")
    return {name: _Stored(tuple(t.shape), str(path), functools.partial(_read_mapped, t)) for name, t in state.items()}


def _read_mapped(tensor: torch.Tensor, dim: int | None, spans: list[tuple[int, int]]) -> torch.Tensor:
    if dim is None:
        return tensor.clone()
    return torch.cat([tensor.narrow(dim, a, b - a) for a, b in spans], dim=dim)  # copies only the slices


def _open_shardwise(path: Path) -> dict[str, _Stored]:
    """A checkpoint of ``engine.save_checkpoint``: ``path`` is the save directory (the
    tag named by ``latest``) or one tag's directory. Every model tensor is stored whole
    under its state-dict name (see [Note: tensor parallelism in checkpoints] in
    ``runtime/_checkpointing.py``); fp32 master weights are preferred where kept. Files
    are not hashed against the manifest (that reads them whole; ``shardwise convert``
    and ``consolidate`` check them)."""
    from shardwise.checkpoint import CheckpointError
    from shardwise.checkpoint._read import read_manifest, resolve_tag
    from shardwise.checkpoint.layout import excludes_frozen

    try:
        tag_dir = path if (path / "manifest.json").is_file() else path / resolve_tag(path)
        manifest = read_manifest(tag_dir)
    except CheckpointError as exc:
        raise ValueError(f"shardwise checkpoint {path}: {exc} (or pass the tag's directory as checkpoint=)") from None
    if excludes_frozen(manifest):
        raise ValueError(
            f"shardwise checkpoint {tag_dir} was saved with exclude_frozen_parameters=True: it holds the trained "
            "parameters but not the frozen ones, so it cannot fill a model alone; build the model from the base "
            "weights, load shardwise.checkpoint.consolidate(checkpoint) into it with strict=False, and pass that "
            "model without checkpoint="
        )
    skeletons = manifest.get("skeletons", {})
    names = _tensor_keys(skeletons.get("module", {}))
    if manifest.get("layout", {}).get("param_dtype", "float32") != "float32":
        names.update(_tensor_keys(skeletons.get("optimizer", {}).get("master", {})))
    for alias, first in skeletons.get("aliases", {}).items():
        names[alias] = names.get(first, names.get(alias))
    files = [*skeletons.get("module_files", ["model.safetensors"]), *skeletons.get("optimizer_files", [])]
    stored: dict[str, _Stored] = {}
    for name in files:
        stored.update(_open_safetensors(tag_dir / name, names))
    return stored


def _tensor_keys(skeleton: dict) -> dict[str, str]:
    return {
        name: entry["__tensor__"]
        for name, entry in skeleton.items()
        if isinstance(entry, dict) and isinstance(entry.get("__tensor__"), str)
    }


# -- matching model tensors to stored ones ---------------------------------------------


def _slots(model: nn.Module) -> list[_Slot]:
    """Parameters and persistent buffers, one slot per tensor (tied names share one)."""
    slots: dict[int, _Slot] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        tensors = [(a, t, True) for a, t in module._parameters.items()]
        tensors += [(a, t, False) for a, t in module._buffers.items() if a not in module._non_persistent_buffers_set]
        for attr, tensor, is_param in tensors:
            if tensor is None:
                continue
            slot = slots.setdefault(id(tensor), _Slot(tensor, [], [], is_param))
            name = _join(prefix, attr)
            if name not in slot.names:
                slot.names.append(name)
                slot.places.append((module, attr))
    return list(slots.values())


def _with_hf_renames(model: nn.Module, stored: dict[str, _Stored]) -> dict[str, _Stored]:
    """Also list each stored tensor under the name ``transformers`` 5 renames it to when
    loading (GPT-NeoX stores ``embed_out``, its model has ``lm_head``). Its converters
    that merge tensors (stacked experts) are not applied: such a model's parameters are
    then reported missing."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings

        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    except Exception as exc:  # noqa: BLE001 - transformers 4, or not a transformers model: names as stored
        logger.debug("init_inference: no transformers key renaming (%s)", exc)
        return stored
    renamed = {apply_renamings(key, renamings): entry for key, entry in stored.items()}
    return {**{k: v for k, v in renamed.items() if k not in stored}, **stored}


def _candidates(model: nn.Module, name: str) -> list[str]:
    """``name`` as the checkpoint may spell it: itself, with DeepSpeed's ``module.``
    prefix, without the base model's prefix (saved from the base model) or with it."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    names = [name]
    if prefix and name.startswith(prefix + "."):
        names.append(name[len(prefix) + 1 :])
    elif prefix and not hasattr(model, prefix):  # model is the base model itself
        names.append(f"{prefix}.{name}")
    return names + [f"module.{n}" for n in names]


def _tied_source(model: nn.Module) -> dict[str, str]:
    """LM head weight name -> input embedding weight name, when the config ties them."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False) or not hasattr(model, "get_output_embeddings"):
        return {}
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embedding is None:
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    head_name, embedding_name = names.get(id(head), ""), names.get(id(embedding), "")
    return {_join(head_name, "weight"): _join(embedding_name, "weight")}


def _join(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


def _plan(model: nn.Module, stored: dict[str, _Stored], checkpoint) -> list[tuple[_Slot, str]]:
    """Each model tensor's stored name, with every name and shape checked before reading."""
    tied = _tied_source(model)
    plan, missing, wrong = [], [], []
    for slot in _slots(model):
        wanted = slot.names + [tied[n] for n in slot.names if n in tied]
        key = next((c for n in wanted for c in _candidates(model, n) if c in stored), None)
        if key is None:
            if slot.is_param:
                missing.append(slot.names[0])
            continue
        expected = _stored_shape(slot.tensor)
        if stored[key].shape != expected:
            wrong.append(
                f"{key!r} is {list(stored[key].shape)} in {stored[key].file} but the model's "
                f"{slot.names[0]!r} is {list(expected)}"
            )
        plan.append((slot, key))
    if wrong:
        raise ValueError(
            f"{_describe(checkpoint)} does not fit the model: {'; '.join(wrong[:3])}"
            f"{'...' if len(wrong) > 3 else ''}; build the model from the checkpoint's own config"
        )
    if missing:
        held = sorted(stored)[:3]
        raise ValueError(
            f"{_describe(checkpoint)} has no tensor for {len(missing)} parameter(s) of the model: "
            f"{', '.join(missing[:_SHOWN])}{'...' if len(missing) > _SHOWN else ''} (it holds e.g. "
            f"{held}); give the checkpoint of this model (same architecture and parameter names)"
        )
    return plan


def _stored_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape the checkpoint stores: the full shape, transposed back for Conv1D."""
    info = shard_info(tensor)
    shape = tuple(info.full_shape) if info is not None else tuple(tensor.shape)
    return shape[::-1] if getattr(tensor, "tensor_parallel_transposed", False) else shape


# -- reading and placing -------------------------------------------------------------------


def _read_slot(slot: _Slot, stored: _Stored) -> torch.Tensor:
    """This rank's part of ``stored`` in the layout ``slot.tensor`` holds it."""
    info = shard_info(slot.tensor)
    if info is None:
        return stored.read(None, [])
    transposed = getattr(slot.tensor, "tensor_parallel_transposed", False)
    dim = len(stored.shape) - 1 - info.dim if transposed else info.dim
    blocks = getattr(slot.tensor, "partition_stride", 1)
    block = stored.shape[dim] // blocks
    piece = block // info.parts
    spans = [(b * block + info.index * piece, b * block + (info.index + 1) * piece) for b in range(blocks)]
    value = stored.read(dim, spans)
    value = value.t().contiguous() if transposed else value
    assert value.shape == slot.tensor.shape, (slot.names[0], value.shape, slot.tensor.shape)
    return value


def _place(slot: _Slot, value: torch.Tensor, dtype: torch.dtype | None) -> None:
    old = slot.tensor
    if not old.is_meta:
        with torch.no_grad():
            old.copy_(value)
        return
    value = value.to(dtype if dtype is not None and old.is_floating_point() else old.dtype)
    if slot.is_param:
        new = nn.Parameter(value, requires_grad=False)
        copy_marks(old, new)
    else:
        new = value
    for module, attr in slot.places:
        (module._parameters if slot.is_param else module._buffers)[attr] = new


def _rebuild_meta_buffers(model: nn.Module) -> None:
    """Give buffers no checkpoint holds (rotary ``inv_freq``) their values by building
    their module again on the CPU from its config (``Module(config=...)``, the
    constructor of Hugging Face's rotary embeddings and attention layers)."""
    for module in model.modules():
        meta = [a for a, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta:
            continue
        fresh = _rebuilt(module, model)
        for attr in meta if fresh is not None else ():
            value = fresh._buffers.get(attr)
            if value is not None and not value.is_meta and value.shape == module._buffers[attr].shape:
                module._buffers[attr] = value


def _rebuilt(module: nn.Module, model: nn.Module) -> nn.Module | None:
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for candidate in (getattr(module, "config", None), text_config, config):
        if candidate is None:
            continue
        try:
            with torch.device("cpu"):
                return type(module)(config=candidate)
        except Exception as exc:  # noqa: BLE001 - not built from a config: try the next one, then give up
            logger.debug("init_inference: rebuilding %s from its config failed: %s", type(module).__name__, exc)
    return None


def _check_no_meta(model: nn.Module, checkpoint) -> None:
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(
            f"after loading {_describe(checkpoint)}, {len(meta)} tensor(s) are still on the meta device "
            f"({', '.join(meta[:_SHOWN])}{'...' if len(meta) > _SHOWN else ''}): the checkpoint does "
            "not hold them and their module cannot be rebuilt from the config; build the model on the "
            "CPU instead of the meta device, or give a checkpoint that holds them"
        )


def _describe(checkpoint) -> str:
    return "the checkpoint dict" if isinstance(checkpoint, dict) else f"checkpoint {os.fspath(checkpoint)!r}"
