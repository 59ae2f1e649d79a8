"""The checkpoint error type, the constants of the on-disk format and small file helpers."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

FORMAT_NAME = "shardwise"
"""Value of ``manifest.json["format"]`` in every shardwise checkpoint."""

FORMAT_VERSION = 1
"""Newest ``format_version`` this code writes and reads."""

MANIFEST_NAME = "manifest.json"
"""File name of the manifest inside a checkpoint directory."""

LATEST_NAME = "latest"
"""File in the save directory that holds the newest tag (DeepSpeed's convention)."""

TENSOR_SUFFIX = ".safetensors"
"""Every tensor file of a checkpoint ends with this suffix."""


class CheckpointError(RuntimeError):
    """A checkpoint on disk is missing, incomplete, damaged or not in shardwise's format.

    The message names the file concerned and what to do about it (load an earlier tag,
    re-save, pass ``tag=``). Wrong arguments (a malformed tag or file name) raise
    ``ValueError`` instead, since no file on disk is at fault.
    """


def validate_tag(tag: str) -> str:
    """Return ``tag`` if it can name a checkpoint directory, else raise ``ValueError``.

    A tag is one path component: non-empty, printable, without ``/``, ``\\`` or ``..``,
    not starting with ``.`` (hidden names are reserved for staging and backup
    directories) and not ``latest`` (that is the file naming the newest tag).
    """
    if not isinstance(tag, str):
        raise ValueError(f"checkpoint tag must be a str, got {type(tag).__name__} {tag!r}")
    problem = None
    if not tag:
        problem = "it is empty"
    elif not tag.isprintable():
        problem = "it contains non-printable characters"
    elif "/" in tag or "\\" in tag:
        problem = "it contains a path separator"
    elif ".." in tag:
        problem = "it contains '..'"
    elif tag.startswith("."):
        problem = "it starts with '.' (reserved for staging directories)"
    elif tag == LATEST_NAME:
        problem = f"'{LATEST_NAME}' is the file that names the newest tag"
    if problem is not None:
        raise ValueError(f"invalid checkpoint tag {tag!r}: {problem}; use a plain name such as 'global_step100'")
    return tag


def validate_file_name(name: str) -> str:
    """Return ``name`` if it can name a tensor file of a checkpoint, else raise ``ValueError``."""
    if (
        not isinstance(name, str)
        or not name.endswith(TENSOR_SUFFIX)
        or name == TENSOR_SUFFIX
        or "/" in name
        or "\\" in name
        or name.startswith(".")
        or not name.isprintable()
    ):
        raise ValueError(
            f"invalid checkpoint file name {name!r}: it must be a plain file name "
            f"ending in {TENSOR_SUFFIX!r}, without path separators or a leading '.'"
        )
    return name


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at ``path``, read in 1 MiB chunks (bounded memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to disk where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
"""safetensors' dtype names, for the files shardwise maps and lays out itself."""
