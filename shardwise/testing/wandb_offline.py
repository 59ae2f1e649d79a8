"""Read the history of an offline Weights & Biases run (``WANDB_MODE=offline``) from its
``run-*.wandb`` file, for tests that check what a run logged without network."""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32768
_HEADER = 7  # ":W&B", a 2-byte magic and a version byte; then a LevelDB-style record log


def _records(data: bytes) -> list[bytes]:
    """The log's records: 7-byte headers (crc, length, kind) in 32 KiB blocks, kinds 1 (full),
    2/3/4 (first/middle/last fragment); a block's tail shorter than a header is padding."""
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file")
    pos, out, pending = _HEADER, [], b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(pending)
            pending = b""
    return out


def offline_history(run_dir: str | Path) -> list[dict]:
    """The rows ``wandb.log`` wrote into the offline run under ``run_dir`` (the ``wandb``
    directory's ``offline-run-*`` folder, or a folder above it holding exactly one)."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(Path(run_dir).rglob("run-*.wandb"))
    if len(files) != 1:
        raise ValueError(f"expected one offline run under {run_dir}, found {len(files)}")
    rows = []
    for raw in _records(files[0].read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            )
    return rows
