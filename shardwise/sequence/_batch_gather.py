"""Every rank's batch on every rank of a group, for ``UlyssesSPDataLoaderAdapter``.

[Note: gathering batches as tensors]
A batch of tensors (a dict of them, as a collator makes) moves in three all-gathers and no
pickling: a fixed-size header (a checksum of the keys, dtypes and dimension counts, and the
byte count), then every tensor's shape, then one flat byte buffer per rank (each tensor's
bytes in key order, padded to the largest rank's count). Every rank sees every header, so
they all take the same path: when a batch holds anything but tensors, or the ranks' batches
differ in keys, dtypes or dimension counts, every rank falls back to
``all_gather_object`` (pickled). The result is in rank order, each batch's keys in its
own order, with the values' dtypes and shapes as they were sent.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

_OBJECTS = -1
"""The checksum of a batch that cannot move as tensors."""


def _signature(batch) -> int:
    if not isinstance(batch, dict) or not batch or not all(torch.is_tensor(v) for v in batch.values()):
        return _OBJECTS
    text = ";".join(f"{k!r}:{v.dtype}:{v.dim()}" for k, v in batch.items())
    return zlib.crc32(text.encode())


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def gather_batches(batch, comm, device=None) -> list:
    """``batch`` of every rank of ``comm`` (a Communicator), in rank order (see
    [Note: gathering batches as tensors]). Tensors move through ``device`` (the CPU for
    gloo, and by default) and arrive there."""
    if comm.world_size == 1:
        return [batch]
    staging = torch.device("cpu") if device is None or dist.get_backend(comm.group) == "gloo" else torch.device(device)
    signature = _signature(batch)
    pieces = [_as_bytes(v.to(staging)) for v in batch.values()] if signature != _OBJECTS else []
    header = torch.tensor([signature, sum(p.numel() for p in pieces)], dtype=torch.int64, device=staging)
    headers = header.new_empty(comm.world_size * 2)
    comm.all_gather_into_tensor(headers, header, tag="sequence-parallel batch headers").wait()
    headers = headers.view(comm.world_size, 2)
    signatures, sizes = headers[:, 0].tolist(), headers[:, 1].tolist()
    if signature == _OBJECTS or any(s != signature for s in signatures):
        everyone = [None] * comm.world_size
        portable = batch
        if isinstance(batch, dict):
            portable = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
        dist.all_gather_object(everyone, portable, group=comm.group)
        return everyone
    shape = torch.tensor([n for v in batch.values() for n in v.shape], dtype=torch.int64, device=staging)
    shapes = shape.new_empty(comm.world_size * shape.numel())
    if shape.numel():
        comm.all_gather_into_tensor(shapes, shape, tag="sequence-parallel batch shapes").wait()
    shapes = shapes.view(comm.world_size, shape.numel())
    longest = max(sizes)
    flat = torch.zeros(longest, dtype=torch.uint8, device=staging)
    if pieces:
        torch.cat(pieces, out=flat[: sizes[comm.rank]])
    flats = flat.new_empty(comm.world_size * longest)
    comm.all_gather_into_tensor(flats, flat, tag="sequence-parallel batches").wait()
    flats = flats.view(comm.world_size, longest)
    return [_unpack(batch, shapes[r].tolist(), flats[r]) for r in range(comm.world_size)]


def _unpack(like: dict, dims: list[int], flat: torch.Tensor) -> dict:
    """A rank's batch from its shapes and bytes, with ``like``'s keys and dtypes."""
    out, offset, dim = {}, 0, 0
    for key, value in like.items():
        shape = dims[dim : dim + value.dim()]
        dim += value.dim()
        count = value.element_size() * int(torch.Size(shape).numel())
        data = flat[offset : offset + count].clone()
        offset += count
        tensor = data.view(value.dtype) if count else torch.empty(0, dtype=value.dtype, device=flat.device)
        out[key] = tensor.reshape(shape)
    return out
