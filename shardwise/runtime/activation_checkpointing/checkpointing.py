"""Activation checkpointing: recompute a block's forward during backward instead of
keeping its activations, with DeepSpeed's ``deepspeed.checkpointing`` functions.

The recomputation is ``torch.utils.checkpoint``'s, which restores the CPU and device RNG
state so dropout masks match the first forward. Megatron's model-parallel RNG tracker
(``get_cuda_rng_tracker``) keeps named RNG states for code written against it.

DeepSpeed's memory options need model parallelism or are not built here yet:
``partition_activations``, ``contiguous_memory_optimization`` and ``cpu_checkpointing``
set to True are refused by ``configure`` with an error naming them, never ignored.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.utils.checkpoint

logger = logging.getLogger("shardwise")

_MODEL_PARALLEL_RNG = "model-parallel-rng"
_settings: dict = {"configured": False, "num_checkpoints": None, "synchronize": False, "profile": False}


def _device_rng_get():
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def _device_rng_set(state) -> None:
    if state is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state)


class CudaRNGStatesTracker:
    """Named RNG states to fork into (Megatron's tracker): ``with tracker.fork(name):``
    draws from ``name``'s generator state and leaves the default one where it was. On a
    machine without CUDA the CPU generator is tracked instead."""

    def __init__(self):
        self.states_: dict = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict:
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Start a named state from ``seed`` (each name and each seed once)."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the RNG tracker")
        self.seeds_.add(seed)
        saved = self._get()
        self._seed(seed)
        self.states_[name] = self._get()
        self._set(saved)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG):
        """Draw from ``name``'s state inside the block; it advances, the default does not."""
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not added to the tracker; call add() first")
        saved = self._get()
        self._set(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = self._get()
            self._set(saved)

    @staticmethod
    def _get():
        return _device_rng_get() if torch.cuda.is_available() else torch.get_rng_state()

    @staticmethod
    def _set(state) -> None:
        if torch.cuda.is_available():
            _device_rng_set(state)
        else:
            torch.set_rng_state(state)

    @staticmethod
    def _seed(seed: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)


_tracker = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's RNG tracker."""
    return _tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with ``seed`` and the tracker's model-parallel state with
    ``seed + 2718 + tensor-parallel rank`` (rank 0: no tensor parallelism here yet)."""
    _tracker.reset()
    CudaRNGStatesTracker._seed(seed)
    _tracker.add(_MODEL_PARALLEL_RNG, seed + 2718)


def checkpoint(function, *args, **kwargs):
    """``function(*args, **kwargs)`` whose activations are recomputed in backward. Outputs
    and gradients equal the un-checkpointed call's (RNG state restored for the recompute);
    tensors passed by keyword take part in autograd like positional ones."""
    if kwargs:
        names, positional = tuple(kwargs), len(args)

        def call(*values, run=function):
            return run(*values[:positional], **dict(zip(names, values[positional:])))

        function, args = call, args + tuple(kwargs.values())
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)


def non_reentrant_checkpoint(function, *args):
    """``checkpoint`` without re-entering autograd (works when no input requires grad)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """Set the options (arguments win over the config's ``activation_checkpointing``
    section). Memory options this version cannot honour are refused."""
    section = {}
    if deepspeed_config is not None:
        from shardwise.config.from_dict import _read

        section = dict(_read(deepspeed_config).get("activation_checkpointing") or {})
    given = {"partition_activations": partition_activations,
             "contiguous_memory_optimization": contiguous_checkpointing,
             "cpu_checkpointing": checkpoint_in_cpu}
    for key, value in given.items():
        if value is None:
            value = section.get(key, False)
        if value:
            raise NotImplementedError(f"activation checkpointing {key}=True is not available in this version "
                                      "of shardwise (it needs tensor parallelism or is not built yet); "
                                      "remove it: activations are recomputed without it")
    if mpu_ is not None:
        raise NotImplementedError("checkpointing.configure(mpu_=...): model parallelism is not available in "
                                  "this version of shardwise yet")
    _settings.update(configured=True,
                     num_checkpoints=num_checkpoints if num_checkpoints is not None else section.get(
                         "number_checkpoints"),
                     synchronize=bool(synchronize if synchronize is not None else section.get(
                         "synchronize_checkpoint_boundary", False)),
                     profile=bool(profile if profile is not None else section.get("profile", False)))


def is_configured() -> bool:
    """Whether ``configure`` has been called."""
    return _settings["configured"]


def reset() -> None:
    """Forget buffers kept between steps (none are kept here); for DeepSpeed scripts."""


def set_num_layers(nlayers: int) -> None:
    _settings["num_checkpoints"] = nlayers


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    if partition_activation:
        raise NotImplementedError("partition_activations needs tensor parallelism, not available in this "
                                  "version of shardwise yet")
