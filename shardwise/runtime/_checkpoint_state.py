"""The stateful parts the engine hands a checkpoint: each saves and restores one kind of
state, and the checkpoint functions (``_checkpointing.py``) see only these and a
``Placement`` (``_placement.py``), never the engine (torchtitan's CheckpointManager idea).

Scheduler, loss scaler, counters, RNG and client state are whole on every rank and have
plain ``state_dict`` / ``load_state_dict``. The module and the optimizer are held as the
ZeRO strategy shards them, so their parts also give the strategy's checkpoint views
(what every rank holds alike, the ZeRO blocks, a bucket's shards): ``ModuleState`` and
``OptimizerState`` hold the strategy's ``views`` (``ZeroViews``) and are the one place
checkpoint code calls them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise import checkpoint as ckpt
from shardwise.runtime._counters import StepCounters
from shardwise.zero._strategy import ShardBlock


class ModuleState:
    """The module's state as the ZeRO strategy holds it, read through its ``views``."""

    def __init__(self, views, *, param_dtype: torch.dtype):
        self._views = views
        self.param_dtype = param_dtype
        """The dtype the module trains in (the manifest records it)."""

    def replicated(self) -> dict:
        """The entries every data rank holds alike (outside ZeRO buckets), by state-dict key."""
        return self._views.module_state_replicated()

    def blocks(self) -> list[ShardBlock]:
        return self._views.module_state_blocks()

    def shards(self, bucket: int) -> AbstractContextManager[dict[str, torch.Tensor]]:
        """This rank's shards of ``bucket``, by block key."""
        return self._views.module_shards(bucket)

    def pieces(self) -> Iterator[dict[str, torch.Tensor]]:
        """The full state dict a piece at a time (collective at stage 3: one unit gathered at a time)."""
        return self._views.module_state_pieces()

    def state_dict(self) -> dict:
        """This rank's full state dict (collective at stage 3)."""
        return self._views.module_state_dict()

    def load_state_dict(self, state: dict, *, strict: bool):
        """Load full tensors (tensor-parallel slices already cut); torch's result."""
        return self._views.load_module_state_dict(state, strict=strict)


class OptimizerState:
    """The optimizer's state by parameter name as the ZeRO strategy holds it, plus the
    state that differs between ranks (``rank_state_dict``: the 1-bit optimizers' error
    buffers) for an optimizer that has some."""

    def __init__(self, views, optimizer):
        self._views = views
        self._optimizer = optimizer

    def replicated(self) -> dict:
        """The named state with the ZeRO-sharded tensors left out (a new dict)."""
        return self._views.optimizer_state_replicated()

    def blocks(self) -> list[ShardBlock]:
        return self._views.optimizer_state_blocks()

    def shards(self, bucket: int) -> AbstractContextManager[dict[str, torch.Tensor]]:
        return self._views.optimizer_shards(bucket)

    def load_state_dict(self, named: dict) -> None:
        """Load the whole named state (tensor-parallel slices already cut, this stage's only)."""
        self._views.load_optimizer_state_by_name(named)

    @property
    def has_rank_state(self) -> bool:
        return hasattr(self._optimizer, "rank_state_dict")

    def rank_state_dict(self) -> dict:
        return self._optimizer.rank_state_dict()

    @property
    def takes_rank_state(self) -> bool:
        return hasattr(self._optimizer, "load_rank_state_dict")

    def load_rank_state_dict(self, state: dict) -> None:
        """This rank's own state; ``{}``: start it afresh (the optimizer says so)."""
        self._optimizer.load_rank_state_dict(state)


class RngState:
    """This process's random number generators (CPU, accelerator, Python, NumPy)."""

    def state_dict(self) -> dict:
        return ckpt.capture_rng_state()

    def load_state_dict(self, state: dict) -> None:
        ckpt.restore_rng_state(state)


@dataclass
class ClientState:
    """The script's own state (``client_state``): saved as given, handed back by a load."""

    value: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        return self.value

    def load_state_dict(self, state: dict) -> None:
        self.value = state


@dataclass(frozen=True)
class Stateful:
    """Everything a checkpoint saves and restores, as the engine hands it over."""

    module: ModuleState
    optimizer: OptimizerState | None
    lr_scheduler: Any | None
    loss_scaler: Any | None
    counters: StepCounters
    accumulation_steps: int
    """Micro-batches per optimizer step now: a load restarts the accumulation window at a
    step boundary, whatever the saved run's were (a different world size changes them)."""
    rng: RngState = field(default_factory=RngState)
    client: ClientState = field(default_factory=ClientState)
    features: Any | None = None
    """The engine's ``TrainingFeatures`` (curriculum, layer drop): ``state_dict`` /
    ``load_state_dict`` of plain data, saved with the engine state."""
