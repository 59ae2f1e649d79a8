"""A stage-3 unit: the parameters one module owns in one param group, and where they are.

[Note: unit states]
A unit is always in exactly one :class:`UnitState`; the transitions below are the only
ones, each made by one method of :class:`Stage3Unit`, and any other raises::

    SHARDED --begin_read--> READING --begin_gather--> GATHERING --finish_gather--> GATHERED
    SHARDED --begin_gather--> GATHERING
    READING / GATHERING / GATHERED --free--> SHARDED

A persistent unit (``stage3_param_persistence_threshold``) is GATHERED from its layout on
and never freed. Whether a unit is needed right now is its use count (``active``, nested
forward calls) and the trace positions of those calls (``calls``); the strategy's
gatherer decides from them when to free it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.comm import Handle
from shardwise.zero._bucket import ShardedBucket


class UnitState(enum.Enum):
    """Where a unit's full parameters are."""

    SHARDED = "sharded"
    """Only this rank's fp32 shard exists; the full buffer's storage is freed and the
    parameters are empty tensors."""
    READING = "reading"
    """The full buffer is allocated and the shard is being read from its swap file
    (offload_param nvme); no collective launched yet."""
    GATHERING = "gathering"
    """The full buffer is allocated and its all-gather is in flight."""
    GATHERED = "gathered"
    """The full buffer holds the parameters and they are views into it."""


class ZeroParamStatus(enum.Enum):
    """A stage-3 parameter's state, DeepSpeed's ``param.ds_status`` (TRL reads it to gather
    a parameter it uses outside its module's forward): whole and usable, partitioned, or
    being gathered. Each parameter's follows its unit's :class:`UnitState`."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


@dataclass(eq=False)
class Stage3Unit(ShardedBucket):
    """A :class:`ShardedBucket` whose full parameters exist only while gathered. See
    [Note: unit states]."""

    module: nn.Module | None = None
    """The module whose forward gathers the unit (the root module for shared parameters
    and persistent units)."""
    persistent: bool = False
    """Stays GATHERED for good (small parameters, ``stage3_param_persistence_threshold``)."""
    state: UnitState = UnitState.GATHERED
    """Laid out whole; the layout frees every non-persistent unit right away."""
    reading: Future | None = None
    """The swap-file read of the shard, while READING."""
    pending: Handle | None = None
    """The all-gather, while GATHERING."""
    active: int = 0
    """Forward calls of its users in progress (nested users keep it gathered)."""
    calls: list[int] = field(default_factory=list)
    """Trace positions of those calls, innermost last."""

    def _move(self, allowed: tuple[UnitState, ...], to: UnitState) -> None:
        if self.state not in allowed:
            raise RuntimeError(f"stage 3 unit {self.index} cannot go from {self.state.name} to {to.name}")
        self.state = to

    def begin_read(self, read: Future) -> None:
        """SHARDED -> READING: allocate the full buffer; ``read`` gives the shard."""
        self._move((UnitState.SHARDED,), UnitState.READING)
        self._allocate()
        self.reading = read

    def take_read(self) -> torch.Tensor:
        """The shard the read gave (waits for it); the unit stays READING until its
        all-gather begins."""
        if self.state is not UnitState.READING or self.reading is None:
            raise RuntimeError(f"stage 3 unit {self.index} has no read in progress ({self.state.name})")
        shard, self.reading = self.reading.result(), None
        return shard

    def begin_gather(self, launch: Callable[[torch.Tensor], Handle]) -> None:
        """SHARDED, or READING with its read taken, -> GATHERING: ``launch(flat_param)``
        starts the all-gather into the (allocated) full buffer."""
        if self.reading is not None:
            raise RuntimeError(f"stage 3 unit {self.index} starts its all-gather before its read is taken")
        was = self.state
        self._move((UnitState.SHARDED, UnitState.READING), UnitState.GATHERING)
        if was is UnitState.SHARDED:
            self._allocate()
        self.pending = launch(self.flat_param)

    def _allocate(self) -> None:
        # see [Note: unshard and reshard by storage resize] in _stage3.py
        self.flat_param.untyped_storage().resize_(self.padded * self.flat_param.element_size())

    def finish_gather(self) -> None:
        """GATHERING -> GATHERED: wait for the all-gather; the parameters view the buffer."""
        self._move((UnitState.GATHERING,), UnitState.GATHERED)
        handle, self.pending = self.pending, None
        handle.wait()
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            p.data = self.flat_param[off : off + shape.numel()].view(shape)
            p.ds_status = ZeroParamStatus.AVAILABLE

    def free(self) -> None:
        """READING, GATHERING or GATHERED -> SHARDED: finish what is in flight (a read nobody
        used launches no collective), free the storage, empty the parameters. A persistent
        unit is never freed."""
        if self.persistent:
            raise RuntimeError(f"stage 3 unit {self.index} is persistent and stays gathered")
        self._move((UnitState.READING, UnitState.GATHERING, UnitState.GATHERED), UnitState.SHARDED)
        if self.reading is not None:
            self.reading.result()
            self.reading = None
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        self.flat_param.untyped_storage().resize_(0)
        for p in self.params:  # an empty tensor, so reading a sharded parameter cannot crash
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE

    def enter(self, position: int) -> None:
        """A user's forward call at trace ``position`` begins."""
        self.active += 1
        self.calls.append(position)

    def exit(self) -> int:
        """The innermost user's forward call ends; returns its trace position."""
        if self.active == 0:
            raise RuntimeError(f"stage 3 unit {self.index} leaves a forward it never entered")
        self.active -= 1
        return self.calls.pop()

    def forget_calls(self) -> None:
        """After backward: no call is in progress."""
        self.active = 0
        self.calls.clear()
