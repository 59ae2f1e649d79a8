"""Find and read checkpoints, checking each file against the manifest before trusting it.

Nothing here unpickles: tensors come from safetensors files and structure from JSON.
Every problem with what is on disk raises ``CheckpointError`` naming the file and a fix.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from shardwise.checkpoint._format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST_NAME,
    MANIFEST_NAME,
    SAFETENSORS_DTYPES,
    CheckpointError,
    sha256_file,
    validate_file_name,
    validate_tag,
)

_DEEPSPEED_SUFFIXES = ("model_states.pt", "optim_states.pt")


def list_tags(load_dir: str | os.PathLike) -> list[str]:
    """Tags of the complete checkpoints in ``load_dir`` (subdirectories with a manifest).

    Sorted so that numbers compare by value (``global_step9`` before ``global_step10``).
    A missing directory has no tags.
    """
    root = Path(load_dir)
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if not p.name.startswith(".") and (p / MANIFEST_NAME).is_file()]
    return sorted(tags, key=_natural_key)


def _natural_key(name: str) -> list:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name) if part]


def resolve_tag(load_dir: str | os.PathLike, tag: str | None = None) -> str:
    """The tag to load from ``load_dir``: ``tag`` itself, or the one named by ``latest``.

    Checks that ``<load_dir>/<tag>`` exists; it does not read the manifest (see
    ``read_manifest``).

    Raises:
        CheckpointError: ``load_dir`` is missing; ``tag`` is None and ``latest`` is
            missing or empty (the message lists the tags found and says to pass
            ``tag=``); or the resolved checkpoint directory does not exist.
    """
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(
            f"checkpoint directory {root} does not exist; check the load_dir "
            "path (it is the directory given to save_checkpoint)"
        )
    if tag is None:
        latest = root / LATEST_NAME
        tag = _read_latest(latest)
        source = f"named by {latest}"
        try:
            validate_tag(tag)
        except ValueError as exc:
            raise CheckpointError(
                f"{latest} holds {tag!r}, which is not a checkpoint tag ({exc}); "
                f"the file was damaged; {_available(root)}"
            ) from exc
    else:
        tag = validate_tag(str(tag))
        source = "passed as tag="
    if not (root / tag).is_dir():
        raise CheckpointError(
            f"checkpoint {root / tag} ({source}) does not exist{_interrupted_hint(root, tag)}; {_available(root)}"
        )
    return tag


def _read_latest(latest: Path) -> str:
    if not latest.is_file():
        raise CheckpointError(
            f"{latest} does not exist, so there is no newest checkpoint to load; {_available(latest.parent)}"
        )
    try:
        text = latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{latest} cannot be read ({exc}); pass tag= to choose a checkpoint; {_available(latest.parent)}"
        ) from exc
    if not text:
        raise CheckpointError(f"{latest} is empty; pass tag= to choose a checkpoint; {_available(latest.parent)}")
    return text


def _available(root: Path) -> str:
    tags = list_tags(root)
    if not tags:
        return f"no checkpoints (directories with {MANIFEST_NAME}) were found in {root}"
    shown = ", ".join(repr(t) for t in tags[:20]) + (", ..." if len(tags) > 20 else "")
    return f"tags found in {root}: {shown}; pass tag= to load one of them"


def _interrupted_hint(root: Path, tag: str) -> str:
    backups = sorted(root.glob(f".{tag}.old-*"))
    if backups:
        return (
            f"; an interrupted overwrite left the previous complete checkpoint at {backups[0]} "
            f"(rename it to {root / tag} to use it)"
        )
    if any(root.glob(f".{tag}.tmp-*")) or (root / f".{tag}.staging").exists():
        return "; a save of this tag was started but not finished (it was interrupted)"
    return ""


def read_manifest(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and validate ``<ckpt_dir>/manifest.json``.

    Returns:
        The manifest: the caller's keys plus ``format``, ``format_version`` and
        ``files`` (``{name: {"bytes": int, "sha256": str}}``).

    Raises:
        CheckpointError: the directory or manifest is missing (with a specific message
            for a DeepSpeed checkpoint directory), the manifest is not valid JSON, is
            not a shardwise manifest, or has a ``format_version`` newer than this code.
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist; {_available(root.parent)}")
    path = root / MANIFEST_NAME
    if not path.is_file():
        deepspeed = sorted(p.name for p in root.iterdir() if p.name.endswith(_DEEPSPEED_SUFFIXES))
        if deepspeed:
            raise CheckpointError(
                f"{root} looks like a DeepSpeed checkpoint (it holds {deepspeed[0]}) rather than a "
                "shardwise one, and converting DeepSpeed checkpoints is not supported yet; load it "
                "with DeepSpeed and save a state_dict, or load the model weights directly"
            )
        raise CheckpointError(
            f"{path} is missing, so {root} is not a complete shardwise checkpoint (the save was "
            "interrupted, or the directory holds something else); load another tag or re-save"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"{path} cannot be parsed ({exc}); the file was damaged or edited; load an earlier tag or re-save"
        ) from exc
    _check_manifest(path, manifest)
    return manifest


def _check_manifest(path: Path, manifest: Any) -> None:
    if not isinstance(manifest, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(manifest).__name__}, not an object; "
            "the file was damaged or edited; load an earlier tag or re-save"
        )
    fmt = manifest.get("format")
    if fmt != FORMAT_NAME:
        raise CheckpointError(
            f"{path} has format {fmt!r}, not {FORMAT_NAME!r}: it was not written "
            "by shardwise; load a checkpoint saved by shardwise's save_checkpoint"
        )
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(
            f"{path} has an invalid format_version {version!r}; the file was "
            "damaged or edited; load an earlier tag or re-save"
        )
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format_version {version}, but this shardwise reads up "
            f"to {FORMAT_VERSION}: it was written by a newer shardwise; "
            "upgrade shardwise"
        )
    files = manifest.get("files")
    valid = isinstance(files, dict) and all(
        isinstance(rec, dict)
        and isinstance(rec.get("bytes"), int)
        and rec["bytes"] >= 0
        and isinstance(rec.get("sha256"), str)
        for rec in files.values()
    )
    if not valid:
        raise CheckpointError(
            f"{path} has a malformed 'files' table; the file was damaged or edited; load an earlier tag or re-save"
        )


def read_tensors(
    ckpt_dir: str | os.PathLike,
    name: str,
    *,
    manifest: Mapping[str, Any] | None = None,
    verify: bool = True,
    mmap: bool = False,
) -> dict[str, torch.Tensor]:
    """Load the tensor file ``name`` of a checkpoint onto the CPU, after checking it.

    The file's size is always compared with the manifest (cheap; catches truncation).
    With ``verify`` its sha256 is compared too, which reads the file once more; turn it
    off only where the storage is trusted and load time matters.

    With ``mmap`` the tensors are views of a private (copy-on-write) mapping of the file:
    pages are read when first touched and, being file pages, are not counted against
    anonymous memory and can be dropped under pressure, so a caller that copies a slice of
    each tensor (a ZeRO rank taking its shard) never holds the whole file. Writing to such
    a tensor changes this process's copy only, never the file.

    Args:
        ckpt_dir: The checkpoint directory ``<load_dir>/<tag>``.
        name: File name as given to ``write_files``, e.g. ``"model.safetensors"``.
        manifest: The result of ``read_manifest(ckpt_dir)``; read here when omitted.
        verify: Whether to check the sha256 recorded in the manifest.

    Returns:
        ``{tensor key: CPU tensor}``.

    Raises:
        ValueError: ``name`` is not a valid checkpoint file name.
        CheckpointError: the manifest does not list ``name``, or the file is missing,
            truncated, the wrong size, corrupted (hash mismatch) or unreadable.
    """
    validate_file_name(name)
    root = Path(ckpt_dir)
    if manifest is None:
        manifest = read_manifest(root)
    path = root / name
    record = manifest["files"].get(name)
    if record is None:
        raise CheckpointError(
            f"{root / MANIFEST_NAME} lists no file {name!r} (it lists "
            f"{sorted(manifest['files'])}); this checkpoint was saved without it"
        )
    expected = record["bytes"]
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint file {path} is missing (the manifest lists it with "
            f"{expected} bytes); it was deleted or not copied with the rest of the "
            "checkpoint; load an earlier tag or re-save"
        )
    size = path.stat().st_size
    if size < expected:
        raise CheckpointError(
            f"checkpoint file {path} is truncated (expected {expected} bytes, found "
            f"{size}); the save was interrupted or the file was damaged; load an "
            "earlier tag or re-save"
        )
    if size > expected:
        raise CheckpointError(
            f"checkpoint file {path} has {size} bytes but the manifest records "
            f"{expected}; the file was damaged or replaced; load an earlier tag or "
            "re-save"
        )
    if verify:
        actual = sha256_file(path)
        if actual != record["sha256"]:
            raise CheckpointError(
                f"checkpoint file {path} is corrupted (sha256 {actual[:16]}... does "
                f"not match the manifest's {record['sha256'][:16]}...); it was "
                "damaged on disk or in transfer; load an earlier tag or re-save"
            )
    try:
        return _map_tensors(path) if mmap else safetensors.torch.load_file(str(path), device="cpu")
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {path} cannot be read as safetensors ({exc}); it was "
            "damaged; load an earlier tag or re-save"
        ) from exc


def _map_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of a private mapping of it (see
    ``read_tensors(mmap=True)``). Raises ValueError for a malformed file."""
    import mmap

    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        size = os.fstat(handle.fileno()).st_size
        if header_len <= 0 or 8 + header_len > size:
            raise ValueError(f"header length {header_len} does not fit a file of {size} bytes")
        header = json.loads(handle.read(header_len))
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    base = 8 + header_len
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {key!r} has dtype {info['dtype']!r}, which shardwise does not read")
        begin, end = info["data_offsets"]
        shape = [int(d) for d in info["shape"]]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        count = 1
        for dim in shape:
            count *= dim
        if end - begin != count * itemsize or base + end > size:
            raise ValueError(f"tensor {key!r}: offsets {begin}..{end} do not hold {shape} {info['dtype']}")
        if count == 0:
            tensors[key] = torch.empty(shape, dtype=dtype)
        elif (base + begin) % itemsize:  # unaligned for its dtype: copy those bytes out
            tensors[key] = torch.frombuffer(bytearray(mapped[base + begin : base + end]), dtype=dtype).view(shape)
        else:
            tensors[key] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + begin).view(shape)
    return tensors
