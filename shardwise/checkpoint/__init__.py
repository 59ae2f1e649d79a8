"""The checkpoint format: tensors by name in safetensors files, structure in JSON.

A checkpoint is a directory ``<save_dir>/<tag>/`` holding ``*.safetensors`` files and a
``manifest.json`` (``format``, ``format_version``, the caller's metadata and a ``files``
table of byte sizes and sha256 digests). ``<save_dir>/latest`` holds the newest tag,
as DeepSpeed writes it. Loading never unpickles anything.

This package is single-process: it does no communication. For a multi-rank save, one
rank calls ``begin_checkpoint(clean=True)``, every rank waits and then calls
``write_files`` for its own files, and one rank calls ``finalize_checkpoint`` with the
gathered records; ``write_checkpoint`` does all of it in one process.

Public API:
    CheckpointError, flatten_state, unflatten_state, write_checkpoint, begin_checkpoint,
    write_files, finalize_checkpoint, write_latest, remove_stale_staging, resolve_tag, list_tags,
    read_manifest, read_tensors, capture_rng_state, restore_rng_state, validate_tag,
    FORMAT_VERSION, consolidate (an engine checkpoint -> one full state dict), and for a
    file that several ranks write in place: tensor_file_layout, create_tensor_file,
    write_into, write_slice_into, seal_tensor_file; TensorSplit (where a tensor-parallel
    slice sits in the full tensor a checkpoint stores).
"""

from shardwise.checkpoint._flatten import flatten_state, unflatten_state
from shardwise.checkpoint._format import FORMAT_VERSION, CheckpointError, validate_tag
from shardwise.checkpoint._read import list_tags, read_manifest, read_tensors, resolve_tag
from shardwise.checkpoint._rng import capture_rng_state, restore_rng_state
from shardwise.checkpoint._tensor_split import TensorSplit
from shardwise.checkpoint._write import (
    begin_checkpoint,
    create_tensor_file,
    finalize_checkpoint,
    remove_stale_staging,
    seal_tensor_file,
    tensor_file_layout,
    write_checkpoint,
    write_files,
    write_into,
    write_latest,
    write_slice_into,
)
from shardwise.checkpoint.layout import consolidate

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "TensorSplit",
    "begin_checkpoint",
    "capture_rng_state",
    "consolidate",
    "create_tensor_file",
    "seal_tensor_file",
    "tensor_file_layout",
    "write_into",
    "write_slice_into",
    "finalize_checkpoint",
    "flatten_state",
    "list_tags",
    "read_manifest",
    "read_tensors",
    "remove_stale_staging",
    "resolve_tag",
    "restore_rng_state",
    "unflatten_state",
    "validate_tag",
    "write_checkpoint",
    "write_files",
    "write_latest",
]
