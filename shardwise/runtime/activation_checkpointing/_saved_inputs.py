"""What a checkpoint keeps of its inputs until the recompute: the tensor itself, a copy in
host memory, or this rank's slice of it (optionally in a preallocated buffer).

[Note: partitioned activations]
Under Megatron-style tensor parallelism the input of a transformer layer is replicated on
every rank of the tensor group, so each rank needs to keep only 1/tp of it. With
``partition_activations`` a checkpoint flattens each floating-point input, pads it to a
multiple of tp and keeps a copy of elements ``[rank*n, (rank+1)*n)`` (a view would keep
the whole tensor alive). The recompute all-gathers the slices across the tensor group;
this rebuilds the input exactly because every rank held the same tensor. Hence:

- An input that differs across the tensor group (a sequence-parallel shard, per-rank
  data) must not be partitioned: the gather would splice ranks' data together. Set
  ``tensor.no_checkpointing = True`` (DeepSpeed's attribute) to keep it whole.
- What is divided is what the checkpoint keeps. The caller's own tensor is freed when the
  caller drops it, as the usual ``h = checkpoint(layer, h)`` loop does. DeepSpeed also
  empties the caller's tensor in place (a ``.data`` swap) and refills it in backward;
  shardwise never changes a caller's tensor, since anything else holding it would read
  garbage.
- Inputs that require grad are partitioned like the others (DeepSpeed does the same):
  the recompute runs on the gathered copy, and that copy's gradient is the input's (the
  same on every tensor rank, as the input is).
- Parameters passed as arguments are kept by reference (they stay alive anyway, so a
  slice would only add memory); so are tensors that are not floating point (masks,
  positions) and tensors with fewer elements than the group has ranks.
- With ``cpu_checkpointing`` the slice (or, unpartitioned, a copy of the input) lives in
  host memory and moves back to the input's device for the recompute.
- ``contiguous_memory_optimization`` writes the slices into one preallocated buffer per
  input position with ``number_checkpoints`` slots, filled in call order. The buffers are
  dropped at the first backward; the slots the checkpoints saved keep a buffer's memory
  until the last of them has run its backward, so the memory comes back in one piece
  instead of fragmenting. Every checkpoint's i-th input needs the same slice size and dtype.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.comm import Communicator

_HOST = torch.device("cpu")


class Stored(enum.Enum):
    """How one argument of a checkpoint is kept until the recompute."""

    OBJECT = "object"  # not a tensor: kept as it is
    WHOLE = "whole"  # the tensor itself (saved for backward by reference)
    HOST = "host"  # a copy in host memory
    SLICE = "slice"  # this rank's slice; see [Note: partitioned activations]


@dataclass(frozen=True)
class StoredInput:
    """The record of one argument: how it is kept and what rebuilds it."""

    kind: Stored
    value: Any = None
    """The argument itself (OBJECT only)."""
    shape: torch.Size | None = None
    device: torch.device | None = None
    """The device the recompute needs the tensor on."""
    requires_grad: bool = False


class ContiguousBuffers:
    """One preallocated buffer per partitioned-input position, with a slot per checkpoint;
    see [Note: partitioned activations]."""

    def __init__(self):
        self._buffers: list[torch.Tensor] = []
        self._used: list[int] = []

    def take_slot(
        self, position: int, numel: int, dtype: torch.dtype, device: torch.device, *, num_slots: int
    ) -> torch.Tensor:
        """The next free slot (``numel`` elements) of buffer ``position``."""
        if position == len(self._buffers):
            self._buffers.append(torch.empty(num_slots * numel, dtype=dtype, device=device))
            self._used.append(0)
        buffer, used = self._buffers[position], self._used[position]
        if buffer.numel() != num_slots * numel or buffer.dtype != dtype or buffer.device != device:
            raise RuntimeError(
                f"contiguous_memory_optimization: partitioned input {position} of this checkpoint has a "
                f"{numel}-element {dtype} slice on {device}, but the buffer was laid out for "
                f"{buffer.numel() // num_slots} {buffer.dtype} elements on {buffer.device} per checkpoint; "
                "it needs checkpoints with the same input sizes (turn it off for mixed layers)"
            )
        if used == num_slots:
            raise RuntimeError(
                f"contiguous_memory_optimization: more than number_checkpoints={num_slots} checkpoint() calls "
                "before a backward; set number_checkpoints to the checkpoints of one forward, or call "
                "deepspeed.checkpointing.reset() after forwards that have no backward"
            )
        self._used[position] = used + 1
        return buffer[used * numel : (used + 1) * numel]

    def clear(self) -> None:
        """Forget the buffers (slots still saved by checkpoints stay valid)."""
        self._buffers, self._used = [], []


@dataclass(frozen=True)
class StoragePolicy:
    """Where a checkpoint keeps its inputs."""

    tensor_comm: Communicator | None = None
    """Partition floating-point inputs across this group (None: keep them whole)."""
    host: bool = False
    """Keep them in host memory (``cpu_checkpointing``)."""
    buffers: ContiguousBuffers | None = None
    """Write slices into these (``contiguous_memory_optimization``)."""
    num_slots: int = 0
    """Slots per buffer (``number_checkpoints``)."""

    def partitions(self, tensor: torch.Tensor) -> bool:
        comm = self.tensor_comm
        return comm is not None and comm.world_size > 1 and tensor.numel() >= comm.world_size


def _is_activation(arg: Any) -> bool:
    return (
        torch.is_tensor(arg)
        and arg.is_floating_point()
        and not isinstance(arg, nn.Parameter)
        and not getattr(arg, "no_checkpointing", False)
    )


def store_inputs(args: tuple, policy: StoragePolicy) -> tuple[list[StoredInput], list[torch.Tensor]]:
    """Decide how each argument is kept; returns the records and the tensors to save for
    backward (one per tensor argument, in order)."""
    records, tensors, position = [], [], 0
    for arg in args:
        if not torch.is_tensor(arg):
            records.append(StoredInput(Stored.OBJECT, value=arg))
            continue
        kind = Stored.WHOLE
        if _is_activation(arg) and policy.partitions(arg):
            kind, kept = Stored.SLICE, _slice(arg, policy, position)
            position += 1
        elif _is_activation(arg) and policy.host:
            kind, kept = Stored.HOST, arg.detach().to(_HOST, copy=True)
        else:
            kept = arg
        records.append(StoredInput(kind, shape=arg.shape, device=arg.device, requires_grad=arg.requires_grad))
        tensors.append(kept)
    return records, tensors


def _slice(arg: torch.Tensor, policy: StoragePolicy, position: int) -> torch.Tensor:
    comm = policy.tensor_comm
    numel, ranks = arg.numel(), comm.world_size
    per_rank = -(-numel // ranks)
    low = min(comm.rank * per_rank, numel)
    high = min(low + per_rank, numel)
    device = _HOST if policy.host else arg.device
    if policy.buffers is not None:
        kept = policy.buffers.take_slot(position, per_rank, arg.dtype, device, num_slots=policy.num_slots)
    else:
        kept = torch.empty(per_rank, dtype=arg.dtype, device=device)
    kept[: high - low].copy_(arg.detach().reshape(-1)[low:high])
    kept[high - low :].zero_()  # padding of the last rank(s)
    return kept


def restore_inputs(records: list[StoredInput], tensors: tuple, policy: StoragePolicy) -> list:
    """The arguments for the recompute: tensors rebuilt, detached, with their original
    ``requires_grad``; other arguments as they were."""
    args, kept = [], iter(tensors)
    for record in records:
        if record.kind is Stored.OBJECT:
            args.append(record.value)
            continue
        tensor = next(kept)
        if record.kind is Stored.HOST:
            tensor = tensor.to(record.device, non_blocking=True)
        elif record.kind is Stored.SLICE:
            tensor = _gather(tensor, record, policy.tensor_comm)
        args.append(tensor.detach().requires_grad_(record.requires_grad))
    return args


def _gather(part: torch.Tensor, record: StoredInput, comm: Communicator) -> torch.Tensor:
    part = part.to(record.device, non_blocking=True)
    full = torch.empty(part.numel() * comm.world_size, dtype=part.dtype, device=part.device)
    with torch.autograd.profiler.record_function("shardwise::activation_checkpointing::all_gather"):
        comm.all_gather_into_tensor(full, part, tag="activation checkpoint input").wait()
    return full[: record.shape.numel()].view(record.shape)
