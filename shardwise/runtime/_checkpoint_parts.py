"""Sharded tensors written into shared part files in place: no rank gathers them to save.

[Note: shards written in place]
A checkpoint stores each sharded tensor whole, under its name and with its full shape, in
``<stem>-00001.safetensors`` and on (about ``part_bytes`` each). Rank 0 of the
grid creates the files with their headers; every rank computes the same offsets
(``tensor_file_layout`` is a pure function) and writes its own elements into place:

- a ZeRO bucket is a flat range of its parameters' tensors back to back, and data rank
  ``r`` holds elements ``[r * shard, (r + 1) * shard)``; it writes the part of each tensor
  its range covers (``open`` gives the shards a bucket at a time: with nvme offload, only
  that bucket is swapped in);
- a tensor that every data rank holds whole (stage 0) is written as if sharded: data rank
  ``r`` writes its ``1 / N`` of it;
- under tensor parallelism a rank's tensor is its tensor rank's slice of the stored one
  (a ``TensorSplit``, see [Note: tensor-parallel slices of stored tensors] in
  ``checkpoint/_tensor_split.py``), so its elements go where the slice sits in the full
  tensor (``write_slice_into``); tensors every tensor rank holds alike are written by
  tensor rank 0.

- under pipeline parallelism each stage writes only its own layers' tensors (a tied
  weight by the first stage holding it); the stages' lists of tensors are all-gathered
  over the pipe group and merged in stage order, so every rank computes the same files
  and offsets, and the parts hold one model's tensors, whatever the number of stages.
- experts split over expert-parallel ranks are written by the ranks holding them, under
  their global names (see [Note: experts in checkpoints] in ``_checkpointing.py``): rank
  ``r`` of an expert's expert-data-parallel group (``holder_rank``) plays the data rank's
  part above, and the lists of tensors are merged over the data group as over stages.

Rank ``r`` starts ``r / N`` of the way through the sources, so ranks mostly write
different files at once; rank ``k % N`` then hashes part ``k``. The parts are ordinary
safetensors files whose tensors are named like any other, so loading needs no knowledge
of the layout that wrote them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from shardwise import checkpoint as ckpt
from shardwise.checkpoint import TensorSplit
from shardwise.comm import Communicator
from shardwise.zero._partition import partition
from shardwise.zero._strategy import MASTER_KEY, PARAM_KEY, ShardBlock


@dataclass(frozen=True)
class Writers:
    """The ranks that save one checkpoint together: the pipe x data x tensor grid. A
    collective runs over the data group, then the tensor group, then the pipe group,
    which together reach every rank (each waits for the previous ones' members)."""

    data: Communicator
    tensor: Communicator | None
    """The tensor group's communicator; None without tensor parallelism."""
    tensor_rank: int
    tensor_size: int
    pipe: Communicator | None = None
    """The pipe group's communicator (one rank per stage); None without pipeline parallelism."""
    stage: int = 0

    @classmethod
    def of(cls, grid) -> Writers:
        """The writers of ``grid`` (a ``ParallelGrid``)."""
        tensor = (None, 0, 1) if grid.tensor == 1 else (grid.tensor_comm, grid.tensor_rank, grid.tensor)
        pipe = (None, 0) if grid.pipe == 1 else (grid.pipe_comm, grid.stage_id)
        return cls(grid.data_comm, *tensor, *pipe)

    @property
    def stages(self) -> int:
        return 1 if self.pipe is None else self.pipe.world_size

    @property
    def rank(self) -> int:
        return (self.stage * self.data.world_size + self.data.rank) * self.tensor_size + self.tensor_rank

    @property
    def size(self) -> int:
        return self.data.world_size * self.tensor_size * self.stages

    def barrier(self, *, tag: str) -> None:
        self.data.barrier(tag=tag)
        if self.tensor is not None:
            self.tensor.barrier(tag=tag)
        if self.pipe is not None:
            self.pipe.barrier(tag=tag)

    def all_gather_object(self, obj, *, tag: str) -> list:
        """Every rank's ``obj``, indexed by ``rank``."""
        by_data = self.data.all_gather_object(obj, tag=tag)
        if self.tensor is not None:
            by_tensor = self.tensor.all_gather_object(by_data, tag=tag)
            by_data = [by_tensor[t][d] for d in range(self.data.world_size) for t in range(self.tensor_size)]
        if self.pipe is None:
            return by_data
        return [obj for stage in self.pipe.all_gather_object(by_data, tag=tag) for obj in stage]

    def stage_lists(self, items: list, *, tag: str, across_data: bool = False) -> list:
        """``items`` of every stage, merged in stage order, the first of equal ones kept
        (collective over the pipe group; every rank of a stage passes the same list, or
        with ``across_data`` the lists of the data ranks are merged first, in rank order)."""
        if across_data:
            items = _merged(self.data.all_gather_object(items, tag=tag))
        if self.pipe is None:
            return list(items)
        return _merged(self.pipe.all_gather_object(items, tag=tag))


def _merged(lists: list[list]) -> list:
    """The items of ``lists`` in order, the first of those with an equal key (``item[0]``) kept."""
    merged, seen = [], set()
    for items in lists:
        for item in items:
            if item[0] not in seen:
                seen.add(item[0])
                merged.append(item)
    return merged


@dataclass(frozen=True)
class PartTensor:
    """One tensor of a part file, and where this rank's elements of it are."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    """As stored: the full tensor."""
    split: TensorSplit | None
    """This tensor rank's slice of it; None: every tensor rank holds all of it."""
    source: str
    """The key of its source tensor in what ``PartGroup.open`` yields."""
    offset: int
    """The element of the source's flat layout where this tensor's elements start."""
    numel: int
    """Its elements on this rank (the slice's, under tensor parallelism)."""
    name: str
    """The parameter (or state-dict key) it belongs to."""


@dataclass(frozen=True)
class PartGroup:
    """Tensors read from one source: a ZeRO bucket's shards, or one whole tensor."""

    tensors: tuple[PartTensor, ...]
    shard: int
    """Data rank ``r`` writes elements ``[r * shard, (r + 1) * shard)`` of the source."""
    open: Callable[[], AbstractContextManager[dict[str, torch.Tensor]]]
    whole: bool
    """Whether the source tensors are whole on every data rank (else each holds its shard)."""
    holder_rank: int | None = None
    """This rank's place among the ranks holding the source when they are not the data
    group (experts: their expert-data-parallel group); None: its data rank."""


def block_key(key: str, name: str) -> str:
    """The tensor key of parameter ``name``'s part of a ``ShardBlock``: its own name for
    module parameters; '/' (never in the dotted keys ``flatten_state`` makes) for optimizer
    state."""
    if key == PARAM_KEY:
        return name
    return f"master/{name}" if key == MASTER_KEY else f"state/{name}/{key}"


def block_groups(blocks: list[ShardBlock], open_shards, splits: dict[str, TensorSplit]) -> list[PartGroup]:
    """One group per ZeRO bucket; ``open_shards(bucket)`` yields this rank's shards by
    block key (``strategy.views.module_shards`` / ``optimizer_shards``)."""
    by_bucket: dict[int, list[ShardBlock]] = {}
    for block in blocks:
        by_bucket.setdefault(block.bucket, []).append(block)
    groups = []
    for bucket, bucket_blocks in by_bucket.items():
        tensors = []
        for block in bucket_blocks:
            offset = 0
            for name, shape in zip(block.names, block.shapes):
                split = splits.get(name)
                stored = split.stored_shape if split is not None else tuple(int(d) for d in shape)
                tensors.append(
                    PartTensor(
                        block_key(block.key, name), block.dtype, stored, split, block.key, offset, shape.numel(), name
                    )
                )
                offset += shape.numel()
        groups.append(
            PartGroup(
                tuple(tensors),
                bucket_blocks[0].shard,
                lambda bucket=bucket: open_shards(bucket),
                whole=False,
                holder_rank=bucket_blocks[0].holder_rank,
            )
        )
    return groups


def whole_group(
    key: str,
    tensor: torch.Tensor,
    split: TensorSplit | None,
    data_size: int,
    *,
    name: str | None = None,
    holders: tuple[int, int] | None = None,
) -> PartGroup:
    """A tensor every data rank holds whole, written ``1 / data_size`` by each (or, given
    ``holders`` = (this rank's place, their number), by the ranks holding it)."""
    stored = split.stored_shape if split is not None else tuple(tensor.shape)
    flat = tensor.detach().reshape(-1)
    entry = PartTensor(key, tensor.dtype, stored, split, "whole", 0, flat.numel(), name or key)
    rank, size = holders if holders is not None else (None, data_size)
    return PartGroup(
        (entry,),
        partition(flat.numel(), size)[1],
        lambda: contextlib.nullcontext({"whole": flat}),
        whole=True,
        holder_rank=rank,
    )


def write_parts(
    writers: Writers, staging, stem: str, groups: list[PartGroup], *, part_bytes: int, across_data: bool = False
) -> tuple[dict, list[str]]:
    """Write ``groups`` into ``<stem>-00001.safetensors``... of about ``part_bytes`` each
    (collective; see [Note: shards written in place]). ``across_data``: the data ranks
    write different tensors (experts). Returns this rank's file records and the part names."""
    entries = writers.stage_lists(
        [(t.key, t.dtype, list(t.shape)) for group in groups for t in group.tensors],
        tag=f"{stem} checkpoint tensors of every stage",
        across_data=across_data,
    )
    if not entries:
        return {}, []
    parts: list[list[tuple]] = []
    size = part_bytes
    for entry in entries:
        nbytes = torch.Size(entry[2]).numel() * torch.empty(0, dtype=entry[1]).element_size()
        if size + nbytes > part_bytes and size > 0:
            parts.append([])
            size = 0
        parts[-1].append(entry)
        size += nbytes
    names = [f"{stem}-{k + 1:05d}.safetensors" for k in range(len(parts))]
    where: dict[str, tuple[str, int]] = {}  # tensor key -> (file, byte offset of its data)
    for name, part in zip(names, parts):
        offsets = (
            ckpt.create_tensor_file(staging / name, part) if writers.rank == 0 else ckpt.tensor_file_layout(part)[1]
        )
        where.update((key, (name, offsets[key])) for key, _, _ in part)
    writers.barrier(tag=f"{stem} checkpoint files created")
    start = len(groups) * writers.rank // writers.size  # ranks start apart: mostly different files at once
    for group in groups[start:] + groups[:start]:
        _write_group(writers, staging, group, where)
    writers.barrier(tag=f"{stem} shards written")
    return {
        name: ckpt.seal_tensor_file(staging / name) for k, name in enumerate(names) if k % writers.size == writers.rank
    }, names


def without_names(groups: list[PartGroup], names: set[str]) -> list[PartGroup]:
    """``groups`` without the tensors of ``names`` (a tied weight another stage writes)."""
    if not names:
        return groups
    return [dataclasses.replace(g, tensors=tuple(t for t in g.tensors if t.name not in names)) for g in groups]


def _write_group(writers: Writers, staging, group: PartGroup, where: dict[str, tuple[str, int]]) -> None:
    low = (writers.data.rank if group.holder_rank is None else group.holder_rank) * group.shard
    high = low + group.shard
    mine = [
        t
        for t in group.tensors
        if (t.split is not None or writers.tensor_rank == 0) and max(t.offset, low) < min(t.offset + t.numel, high)
    ]
    if not mine:
        return
    with group.open() as sources:
        for tensor in mine:
            start, end = max(tensor.offset, low), min(tensor.offset + tensor.numel, high)
            base = 0 if group.whole else low
            data = sources[tensor.source][start - base : end - base]
            name, offset = where[tensor.key]
            if tensor.split is None:
                ckpt.write_into(staging / name, offset + (start - tensor.offset) * data.element_size(), data)
            else:
                ckpt.write_slice_into(staging / name, offset, tensor.split, start - tensor.offset, data)
