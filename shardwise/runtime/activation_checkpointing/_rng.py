"""Random-number state for activation checkpointing: Megatron's named-state tracker and the
snapshot a checkpoint replays so that its recompute draws the same numbers.

[Note: checkpoint RNG replay]
A recompute must see the random streams the first forward saw, or its dropout masks
differ and the gradients are wrong. Three streams are involved: the CPU generator, the
accelerator's generator (CUDA only; on CPU it is the CPU generator), and every named
state of the tracker (``with tracker.fork():`` draws from one of those instead of the
default stream). ``RngSnapshot.capture()`` takes all three before the forward;
``replay()`` installs them for the recompute and puts back whatever was current at
backward time afterwards, so the recompute does not disturb later draws.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from shardwise.accelerator import get_accelerator

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The tracker state ``model_parallel_cuda_manual_seed`` adds (Megatron's name)."""
TENSOR_SEED_OFFSET = 2718
"""The model-parallel state starts from ``seed + 2718 + tensor rank`` (Megatron's offset)."""


class CudaRNGStatesTracker:
    """Named RNG states to fork into (Megatron's tracker): ``with tracker.fork(name):``
    draws from ``name``'s generator state and leaves the default one where it was. The
    states are the accelerator's generator (the CPU generator on a CPU machine)."""

    def __init__(self):
        self.states_: dict = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        """Forget every named state and seed."""
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict:
        """A copy of the name -> state map (states are replaced, never mutated, by ``fork``)."""
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        """Install a map from :meth:`get_states`."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Start a named state from ``seed`` (each name and each seed once)."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the RNG tracker")
        self.seeds_.add(seed)
        accelerator = get_accelerator()
        saved = accelerator.get_rng_state()
        accelerator.manual_seed(seed)
        self.states_[name] = accelerator.get_rng_state()
        accelerator.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from ``name``'s state inside the block; it advances, the default does not."""
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not added to the tracker; call add() first")
        accelerator = get_accelerator()
        saved = accelerator.get_rng_state()
        accelerator.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = accelerator.get_rng_state()
            accelerator.set_rng_state(saved)


TRACKER = CudaRNGStatesTracker()
"""The process's tracker (DeepSpeed's and Megatron's API reach it through a function)."""


def seed_model_parallel(seed: int, *, tensor_rank: int) -> None:
    """Seed the accelerator's default generator (the CPU one on a CPU machine) with ``seed``,
    the same on every tensor rank (dropout outside ``fork()`` agrees across the group), and
    the tracker's model-parallel state with ``seed + 2718 + tensor_rank``, different per
    tensor rank (dropout inside ``fork()``)."""
    TRACKER.reset()
    get_accelerator().manual_seed(seed)
    TRACKER.add(MODEL_PARALLEL_RNG, seed + TENSOR_SEED_OFFSET + tensor_rank)


@dataclass(frozen=True)
class RngSnapshot:
    """The random streams of one moment; see [Note: checkpoint RNG replay]."""

    cpu: torch.Tensor
    device: torch.Tensor | None
    """The CUDA generator's state (None on a CPU accelerator: ``cpu`` covers it)."""
    tracker: dict

    @staticmethod
    def capture() -> RngSnapshot:
        accelerator = get_accelerator()
        device = accelerator.get_rng_state() if accelerator.device_type != "cpu" else None
        return RngSnapshot(torch.get_rng_state(), device, TRACKER.get_states())

    def install(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            get_accelerator().set_rng_state(self.device)
        TRACKER.set_states(self.tracker)

    @contextlib.contextmanager
    def replay(self):
        """Run the block with these streams, then restore the ones current on entry."""
        current = RngSnapshot.capture()
        self.install()
        try:
            yield
        finally:
            current.install()
