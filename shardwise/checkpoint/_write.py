"""Write a checkpoint so that a crash at any moment leaves a complete one on disk.

[Note: atomic checkpoint install]
Files are written into a staging directory next to the final one (same file system, so
renames are atomic), each fsynced and hashed. The manifest is written last, then the
staging directory is renamed to ``<save_dir>/<tag>``. Overwriting an existing tag
renames the old directory to ``.<tag>.old-<random>`` first, renames the new one into
place and only then deletes the old one; a crash between the two renames leaves both
complete copies under hidden names, and ``resolve_tag`` points at them. ``latest`` is
replaced last with ``os.replace``, so it always names a complete checkpoint.

Several ranks can write one checkpoint together with no communication in this layer:
one rank calls ``begin_checkpoint(clean=True)``, all ranks wait (a barrier, done by the
caller), every rank calls ``write_files`` for its own file names into the same staging
directory, the caller gathers the returned records on one rank, and that rank calls
``finalize_checkpoint``. ``write_checkpoint`` does all of it in one process.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import time
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
    TENSOR_SUFFIX,
    CheckpointError,
    fsync_dir,
    sha256_file,
    validate_file_name,
    validate_tag,
)
from shardwise.checkpoint._tensor_split import TensorSplit

_RESERVED_KEYS = ("format", "format_version", "files")
_STAGING_SUFFIX = ".staging"


def staging_path(save_dir: str | os.PathLike, tag: str) -> Path:
    """The staging directory ``<save_dir>/.<tag>.staging`` that every rank derives alike."""
    return Path(save_dir) / f".{validate_tag(tag)}{_STAGING_SUFFIX}"


def begin_checkpoint(save_dir: str | os.PathLike, tag: str, *, clean: bool = True) -> Path:
    """Prepare the staging directory for checkpoint ``tag`` and return its path.

    The path is deterministic (``<save_dir>/.<tag>.staging``) so that all ranks agree on
    it without communicating. Exactly one rank passes ``clean=True``: it creates
    ``save_dir`` if needed, removes a staging directory left by an interrupted save and
    creates an empty one. The other ranks pass ``clean=False``, which only computes the
    path, and must wait (barrier) for the cleaning rank before calling ``write_files``.
    Staging directories of other tags are ``remove_stale_staging``'s to clean.

    Args:
        save_dir: Directory that holds the checkpoints (one subdirectory per tag).
        tag: Name of the checkpoint, e.g. ``"global_step100"``; see ``validate_tag``.
        clean: Whether this call (re)creates the staging directory on disk.

    Raises:
        ValueError: ``tag`` is not a valid directory name.
    """
    path = staging_path(save_dir, tag)
    if clean:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
    return path


STALE_STAGING_AGE_S = 600.0
"""A staging directory with nothing modified for this many seconds is taken as left by a
killed save (see [Note: stale staging directories])."""


def remove_stale_staging(
    save_dir: str | os.PathLike, *, current_tag: str, min_age_s: float = STALE_STAGING_AGE_S
) -> tuple[list[Path], dict[Path, str]]:
    """Remove the staging directories that interrupted saves left in ``save_dir``.

    [Note: stale staging directories]
    A save killed before ``finalize_checkpoint`` leaves ``.<tag>.staging`` behind, and
    ``begin_checkpoint`` removes it only when that tag is saved again; so the rank that
    cleans calls this before every save. Only directories named ``.<valid tag>.staging``
    are candidates: complete checkpoints have no leading dot, ``.<tag>.old-*`` may be the
    only complete copy of a tag (see [Note: atomic checkpoint install]) and
    ``.<tag>.tmp-*`` belongs to a ``write_checkpoint`` that may be running in another
    process, so none of those is ever touched. ``current_tag``'s directory is skipped: it
    is the one being (re)created. Saves are collective, so no other save of the calling
    job is running. A candidate is kept and reported, not removed, when it is not a plain
    directory (a symlink points at data that is not ours), when it holds a manifest (the
    save was finished and only the rename into place was lost: a complete checkpoint), or
    when anything in it changed within ``min_age_s`` (another job may be writing to the
    same ``save_dir`` now).

    Args:
        save_dir: Directory that holds the checkpoints; a missing one has nothing to remove.
        current_tag: Tag of the save about to begin.
        min_age_s: Seconds a directory must have been left untouched to be removed.

    Returns:
        ``(removed, kept)``: the paths removed, and ``{path: why it was kept}``.
    """
    root = Path(save_dir)
    removed: list[Path] = []
    kept: dict[Path, str] = {}
    if not root.is_dir():
        return removed, kept
    for path in sorted(root.iterdir()):
        if not (path.name.startswith(".") and path.name.endswith(_STAGING_SUFFIX)):
            continue
        tag = path.name[1 : -len(_STAGING_SUFFIX)]
        try:
            validate_tag(tag)
        except ValueError:
            continue
        if tag == current_tag:
            continue
        reason = _unsafe_to_remove(path, tag, min_age_s)
        if reason is None:
            try:
                shutil.rmtree(path)
            except OSError as exc:
                reason = f"removing it failed ({exc})"
        if reason is None:
            removed.append(path)
        else:
            kept[path] = reason
    return removed, kept


def _unsafe_to_remove(path: Path, tag: str, min_age_s: float) -> str | None:
    """Why the staging directory ``path`` must stay, or None (see [Note: stale staging directories])."""
    if path.is_symlink() or not path.is_dir():
        return "it is not a plain directory; remove it yourself if no save is using it"
    if (path / MANIFEST_NAME).is_file():
        return (
            f"it holds a finished checkpoint that was never moved into place; rename it to "
            f"{path.parent / tag} to keep it, or delete it"
        )
    with os.scandir(path) as entries:
        newest = max([path.lstat().st_mtime] + [e.stat(follow_symlinks=False).st_mtime for e in entries])
    age = time.time() - newest
    if age < min_age_s:
        return (
            f"it was modified {age:.0f} s ago (less than {min_age_s:.0f} s), so a save in another "
            "job may still be writing it; it is removed at a later save once untouched"
        )
    return None


def write_files(
    staging_dir: str | os.PathLike, files: Mapping[str, Mapping[str, torch.Tensor]]
) -> dict[str, dict[str, Any]]:
    """Write each entry of ``files`` as a safetensors file in ``staging_dir``.

    Each file is fsynced and hashed before this returns, so the records can go into the
    manifest. Tensors should come from ``flatten_state`` (contiguous CPU copies that share
    no storage); other tensors are moved to CPU and made contiguous here, and safetensors
    rejects tensors that share storage.

    Args:
        staging_dir: Directory from ``begin_checkpoint``; it must already exist.
        files: ``{file name: {tensor key: tensor}}``; names end in ``.safetensors`` and
            contain no path separator. Each name may be written once per checkpoint.

    Returns:
        ``{file name: {"bytes": size, "sha256": hex digest}}`` for ``finalize_checkpoint``.

    Raises:
        ValueError: a file name is invalid.
        CheckpointError: the staging directory is missing or a file already exists in it.
    """
    staging = Path(staging_dir)
    if not staging.is_dir():
        raise CheckpointError(
            f"staging directory {staging} does not exist; call begin_checkpoint(..., clean=True) on "
            "one rank and wait for it (a barrier) before any rank writes files"
        )
    for name in files:
        validate_file_name(name)
    records: dict[str, dict[str, Any]] = {}
    for name, tensors in files.items():
        path = staging / name
        if path.exists():
            raise CheckpointError(
                f"{path} already exists in the staging directory: two ranks wrote the same file "
                "name, or the staging directory was not cleaned by begin_checkpoint(clean=True)"
            )
        records[name] = _write_one(path, tensors)
    fsync_dir(staging)
    return records


def _write_one(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    prepared = {}
    for key, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"{path.name}: value for key {key!r} is a {type(tensor).__qualname__}, "
                "not a tensor; split nested state with flatten_state first"
            )
        prepared[key] = tensor.detach().cpu().contiguous()
    # Called through the module so a single attribute is the one place that writes tensors.
    safetensors.torch.save_file(prepared, str(path), metadata={"format": "pt"})
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
        size = os.fstat(handle.fileno()).st_size
    return {"bytes": size, "sha256": sha256_file(path)}


def tensor_file_layout(entries) -> tuple[bytes, dict[str, int], int]:
    """The layout of a safetensors file holding ``entries`` (``(key, dtype, shape)``, data
    in this order). Returns ``(header bytes, {key: absolute byte offset of its data}, file
    size)``. A pure function, so every rank that writes into the file computes the same
    offsets without communicating (see ``create_tensor_file`` and ``write_into``)."""
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    relative, position = {}, 0
    for key, dtype, shape in entries:
        if key in header:
            raise ValueError(f"tensor key {key!r} appears twice in one file")
        if dtype not in names:
            raise TypeError(f"cannot lay out tensor {key!r} of dtype {dtype} in a safetensors file")
        numel = 1
        for dim in shape:
            numel *= int(dim)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        header[key] = {
            "dtype": names[dtype],
            "shape": [int(d) for d in shape],
            "data_offsets": [position, position + nbytes],
        }
        relative[key] = position
        position += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header with spaces to 8 bytes
    prefix = len(text).to_bytes(8, "little") + text
    return prefix, {key: len(prefix) + offset for key, offset in relative.items()}, len(prefix) + position


def create_tensor_file(path: str | os.PathLike, entries) -> dict[str, int]:
    """Create the safetensors file ``path`` for ``entries`` with its data still to be
    written in place (``write_into``, by any process); returns each key's byte offset.
    Call ``seal_tensor_file`` once every write is done."""
    path = Path(path)
    validate_file_name(path.name)
    prefix, offsets, size = tensor_file_layout(entries)
    with open(path, "xb") as handle:
        handle.write(prefix)
        handle.truncate(size)
    return offsets


def write_into(path: str | os.PathLike, offset: int, tensor: torch.Tensor) -> None:
    """Write ``tensor``'s bytes at byte ``offset`` of the file ``path`` (no copy of a
    contiguous CPU tensor)."""
    fd = _open_for_writing(path)
    try:
        _pwrite_tensor(fd, tensor.detach().cpu().contiguous(), offset)
    finally:
        os.close(fd)


_POSITIONS_CHUNK = 1 << 20
"""Elements of a slice mapped to stored positions at once by ``write_slice_into`` (bounds
its index tensors to a few tens of MiB)."""


def write_slice_into(path: str | os.PathLike, offset: int, split: TensorSplit, start: int, data: torch.Tensor) -> None:
    """Write elements ``[start, start + data.numel())`` of a tensor-parallel slice (in the
    slice's row-major order; ``split`` says which slice) where they belong in the full
    tensor stored at byte ``offset`` of ``path``. Consecutive positions go out as one
    write each: a contiguous chunk is one write, a column block one per stored row. See
    [Note: tensor-parallel slices of stored tensors] in ``_tensor_split.py``."""
    data = data.detach().cpu().reshape(-1)
    itemsize = data.element_size()
    fd = _open_for_writing(path)
    try:
        for low in range(0, data.numel(), _POSITIONS_CHUNK):
            piece = data[low : low + _POSITIONS_CHUNK]
            where = split.positions(start + low, start + low + piece.numel())
            if where.numel() > 1 and not bool((where[1:] > where[:-1]).all()):
                order = torch.argsort(where)  # write in stored order: longer runs (a transposed slice)
                where, piece = where[order], piece[order]
            breaks = (torch.nonzero(where[1:] - where[:-1] != 1).flatten() + 1).tolist()
            bounds = [0, *breaks, where.numel()]
            for a, b in zip(bounds, bounds[1:]):
                _pwrite_tensor(fd, piece[a:b].contiguous(), offset + int(where[a]) * itemsize)
    finally:
        os.close(fd)


def _open_for_writing(path: str | os.PathLike) -> int:
    try:
        return os.open(path, os.O_WRONLY)
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{path} does not exist here: the rank that creates it (create_tensor_file) "
            "writes to another file system; every rank must see the same save_dir "
            "(a shared file system across machines)"
        ) from exc


def _pwrite_tensor(fd: int, tensor: torch.Tensor, offset: int) -> None:
    """Write the bytes of the contiguous CPU ``tensor`` at ``offset`` of the open file ``fd``."""
    # the bytes through ctypes, not .numpy(): that would make the tensor's storage
    # non-resizable for good, and ZeRO-3 frees and re-allocates parameter storage
    nbytes = tensor.numel() * tensor.element_size()
    data = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B") if nbytes else b""
    done = 0
    while done < len(data):  # short writes are legal; finish the request
        done += os.pwrite(fd, data[done : done + (1 << 26)], offset + done)


def seal_tensor_file(path: str | os.PathLike) -> dict[str, Any]:
    """Flush a file every writer has finished (``write_into``) and return its record for
    ``finalize_checkpoint``."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
        size = os.fstat(handle.fileno()).st_size
    return {"bytes": size, "sha256": sha256_file(Path(path))}


def finalize_checkpoint(
    save_dir: str | os.PathLike,
    tag: str,
    staging_dir: str | os.PathLike,
    *,
    manifest: Mapping[str, Any],
    file_records: Mapping[str, Mapping[str, Any]],
    save_latest: bool,
) -> Path:
    """Write the manifest, move the staging directory into place and update ``latest``.

    Call on one rank after every rank's ``write_files`` returned. The staged files are
    checked against ``file_records`` (every record present with its size, no unrecorded
    file), so a rank whose records were not gathered is caught here rather than at load.
    See [Note: atomic checkpoint install]. If anything fails before the new checkpoint is
    in place, the staging directory is removed and the previous checkpoint of ``tag`` and
    ``latest`` are left as they were.

    Args:
        save_dir: Directory that holds the checkpoints; ``staging_dir`` must be inside it.
        tag: Name of the checkpoint directory to create or replace.
        staging_dir: Directory the files were written to.
        manifest: Caller's JSON-serialisable metadata (counters, layout, skeletons);
            the keys ``format``, ``format_version`` and ``files`` are added here and
            must not be present.
        file_records: Merged return values of ``write_files`` from all ranks.
        save_latest: Whether ``<save_dir>/latest`` should name this tag afterwards.

    Returns:
        The path ``<save_dir>/<tag>``.

    Raises:
        ValueError: a reserved manifest key is set, or ``tag`` is invalid.
        TypeError: ``manifest`` is not JSON-serialisable.
        CheckpointError: the staged files do not match ``file_records``.
    """
    validate_tag(tag)
    save_dir, staging = Path(save_dir), Path(staging_dir)
    try:
        text = _manifest_text(manifest, file_records)
        _check_staged_files(staging, file_records)
        _write_synced(staging / MANIFEST_NAME, text)
        fsync_dir(staging)
        final = _install(save_dir, tag, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if save_latest:
        write_latest(save_dir, tag)
    return final


def write_checkpoint(
    save_dir: str | os.PathLike,
    tag: str,
    *,
    files: Mapping[str, Mapping[str, torch.Tensor]],
    manifest: Mapping[str, Any],
    save_latest: bool = True,
) -> Path:
    """Atomically write checkpoint ``<save_dir>/<tag>`` from one process.

    Stages into ``<save_dir>/.<tag>.tmp-<random>`` (so concurrent single-process saves do
    not collide), then ``write_files`` and ``finalize_checkpoint``; see [Note: atomic
    checkpoint install]. On any exception the staging directory is removed and the
    previous checkpoint and ``latest`` are untouched.

    Args:
        save_dir: Directory that holds the checkpoints; created if missing.
        tag: Name of the checkpoint directory, e.g. ``"global_step100"``.
        files: ``{file name: {tensor key: tensor}}``, usually from ``flatten_state``.
        manifest: JSON-serialisable metadata, e.g. the skeletons from ``flatten_state``.
        save_latest: Whether ``<save_dir>/latest`` should name this tag afterwards.

    Returns:
        The path ``<save_dir>/<tag>``.
    """
    validate_tag(tag)
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    staging = save_dir / f".{tag}.tmp-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        records = write_files(staging, files)
        return finalize_checkpoint(
            save_dir, tag, staging, manifest=manifest, file_records=records, save_latest=save_latest
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_latest(save_dir: str | os.PathLike, tag: str) -> None:
    """Atomically make ``<save_dir>/latest`` hold ``tag`` (just the tag, as DeepSpeed writes)."""
    validate_tag(tag)
    save_dir = Path(save_dir)
    tmp = save_dir / f".{LATEST_NAME}.tmp-{secrets.token_hex(4)}"
    try:
        _write_synced(tmp, tag)
        os.replace(tmp, save_dir / LATEST_NAME)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(save_dir)


def _manifest_text(manifest: Mapping[str, Any], file_records: Mapping[str, Mapping[str, Any]]) -> str:
    clash = [key for key in _RESERVED_KEYS if key in manifest]
    if clash:
        raise ValueError(f"manifest keys {clash} are reserved for the checkpoint format; rename them")
    files = {
        name: {"bytes": int(rec["bytes"]), "sha256": str(rec["sha256"])} for name, rec in sorted(file_records.items())
    }
    full = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **manifest, "files": files}
    try:
        return json.dumps(full, indent=1, allow_nan=False, ensure_ascii=True) + "\n"
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"the checkpoint manifest is not plain JSON ({exc}); store nested state "
            "through flatten_state and put only its skeleton in the manifest"
        ) from exc


def _check_staged_files(staging: Path, file_records: Mapping[str, Mapping[str, Any]]) -> None:
    if not staging.is_dir():
        raise CheckpointError(
            f"staging directory {staging} does not exist; it was removed while "
            "the checkpoint was being written; save again"
        )
    for name, record in file_records.items():
        validate_file_name(name)
        path = staging / name
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing from the staging directory although a rank "
                "reported writing it; check that all ranks share save_dir"
            )
        size = path.stat().st_size
        if size != record["bytes"]:
            raise CheckpointError(
                f"{path} has {size} bytes but its writer reported "
                f"{record['bytes']}; another process wrote to the staging directory"
            )
    unrecorded = sorted(
        p.name for p in staging.iterdir() if p.name.endswith(TENSOR_SUFFIX) and p.name not in file_records
    )
    if unrecorded:
        raise CheckpointError(
            f"files {unrecorded} in {staging} have no record; pass the records "
            "returned by write_files on every rank to finalize_checkpoint"
        )


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _install(save_dir: Path, tag: str, staging: Path) -> Path:
    final = save_dir / tag
    backup = None
    if final.exists() or final.is_symlink():
        backup = save_dir / f".{tag}.old-{secrets.token_hex(4)}"
        os.rename(final, backup)
    try:
        os.rename(staging, final)
    except BaseException:
        if backup is not None:
            os.rename(backup, final)
        raise
    fsync_dir(save_dir)
    if backup is not None:
        if backup.is_dir() and not backup.is_symlink():
            shutil.rmtree(backup)
        else:
            backup.unlink()
    return final
