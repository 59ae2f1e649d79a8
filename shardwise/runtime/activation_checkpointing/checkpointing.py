"""Activation checkpointing with DeepSpeed's API (``deepspeed.checkpointing``): recompute a
block's forward during backward instead of keeping its activations.

Typical use (Megatron-DeepSpeed)::

    deepspeed.checkpointing.configure(mpu, deepspeed_config=args.deepspeed_config)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(seed)
    for layer in layers:
        hidden = deepspeed.checkpointing.checkpoint(layer, hidden, mask)

``checkpoint`` keeps only the block's inputs, replays every random stream for the
recompute (dropout masks match the first forward, inside ``get_cuda_rng_tracker().fork()``
too; see [Note: checkpoint RNG replay]) and can keep those inputs partitioned across the
tensor-parallel group and/or in host memory (see [Note: partitioned activations]).
The engine does not call ``configure`` (DeepSpeed's does not either): the config's
``activation_checkpointing`` section applies once the script passes the config to it.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.utils.checkpoint

from shardwise.accelerator import get_accelerator
from shardwise.config import ActivationCheckpointingConfig, ConfigError, TrainConfig, activation_checkpointing_config
from shardwise.runtime.activation_checkpointing._function import CheckpointFunction
from shardwise.runtime.activation_checkpointing._rng import (
    MODEL_PARALLEL_RNG,
    TENSOR_SEED_OFFSET,
    TRACKER,
    CudaRNGStatesTracker,
    seed_model_parallel,
)
from shardwise.runtime.activation_checkpointing._settings import SETTINGS
from shardwise.utils._logging import log_dist

logger = logging.getLogger("shardwise")

__all__ = [
    "CudaRNGStatesTracker",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]


def _section(deepspeed_config) -> tuple[ActivationCheckpointingConfig, float | None]:
    """The ``activation_checkpointing`` section (and ``comm.timeout_s`` where known) of a
    dict, JSON path, TrainConfig, DeepSpeedConfig or the section itself."""
    from shardwise.runtime.config import DeepSpeedConfig

    if deepspeed_config is None:
        return ActivationCheckpointingConfig(), None
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config, None
    if isinstance(deepspeed_config, DeepSpeedConfig):
        deepspeed_config = deepspeed_config.config
    if isinstance(deepspeed_config, TrainConfig):
        return deepspeed_config.activation_checkpointing, deepspeed_config.comm.timeout_s
    return activation_checkpointing_config(deepspeed_config), None


def configure(
    mpu_=None,
    deepspeed_config=None,
    partition_activations=None,
    contiguous_checkpointing=None,
    num_checkpoints=None,
    checkpoint_in_cpu=None,
    synchronize=None,
    profile=None,
) -> None:
    """Set how ``checkpoint`` stores inputs, as DeepSpeed's ``configure``.

    Every option starts from its default, then takes the config's
    ``activation_checkpointing`` section, then the arguments that are not None.

    Args:
        mpu_: Megatron-style model-parallel object: its tensor-parallel group
            (``get_tensor_model_parallel_group/rank/world_size``, else
            ``get_model_parallel_*``) partitions activations and seeds
            ``model_parallel_cuda_manual_seed``. None keeps the one given before (DeepSpeed's rule).
        deepspeed_config: dict, JSON path, TrainConfig or DeepSpeedConfig; only its
            ``activation_checkpointing`` section is read.
        partition_activations: keep each rank's 1/tp slice of every floating-point input;
            all-gathered for the recompute. With no mpu_ or a 1-rank group inputs stay whole
            (as in DeepSpeed), with a warning.
        contiguous_checkpointing: write the slices into one preallocated buffer per input
            position (``contiguous_memory_optimization``); needs partition_activations
            and num_checkpoints.
        num_checkpoints: checkpoint calls per forward (``number_checkpoints``).
        checkpoint_in_cpu: keep the stored inputs in host memory (``cpu_checkpointing``).
        synchronize: synchronize the device at the start and end of each checkpoint's
            forward and backward (``synchronize_checkpoint_boundary``).
        profile: log each checkpoint's forward and backward time (``profile``).

    Raises:
        ConfigError: contiguous_checkpointing without partition_activations or
            num_checkpoints, or a bad config section.
    """
    section, timeout_s = _section(deepspeed_config)
    mpu = mpu_ if mpu_ is not None else SETTINGS.mpu

    def pick(argument, from_config):
        return from_config if argument is None else argument

    partition = bool(pick(partition_activations, section.partition_activations))
    contiguous = bool(pick(contiguous_checkpointing, section.contiguous_memory_optimization))
    slots = pick(num_checkpoints, section.number_checkpoints)
    if contiguous and not partition:
        raise ConfigError(
            "activation checkpointing: contiguous_memory_optimization lays out activation "
            "partitions and needs partition_activations=true; enable it or turn the option off"
        )
    if contiguous and slots is None:
        raise ConfigError(
            "activation checkpointing: contiguous_memory_optimization needs number_checkpoints "
            "(checkpoint() calls per forward, e.g. the layer count); set it in the config, pass "
            "num_checkpoints= to configure() or call set_num_layers()"
        )
    SETTINGS.reset()
    SETTINGS.mpu, SETTINGS.partition_activations, SETTINGS.contiguous_memory_optimization = mpu, partition, contiguous
    SETTINGS.num_checkpoints = slots
    SETTINGS.cpu_checkpointing = bool(pick(checkpoint_in_cpu, section.cpu_checkpointing))
    SETTINGS.synchronize = bool(pick(synchronize, section.synchronize_checkpoint_boundary))
    SETTINGS.profile = bool(pick(profile, section.profile))
    if timeout_s is not None:
        SETTINGS.comm_timeout_s = timeout_s
    SETTINGS.connect()
    SETTINGS.configured = True
    log_dist(
        f"activation checkpointing: partition_activations={partition} (tensor-parallel ranks: "
        f"{SETTINGS.tensor_comm.world_size if SETTINGS.tensor_comm else 1}), cpu_checkpointing="
        f"{SETTINGS.cpu_checkpointing}, contiguous_memory_optimization={contiguous} (number_checkpoints="
        f"{slots}), synchronize={SETTINGS.synchronize}, profile={SETTINGS.profile}",
        ranks=[0],
    )


def is_configured() -> bool:
    """Whether ``configure`` has been called."""
    return SETTINGS.configured


def reset() -> None:
    """Drop the contiguous buffers being filled (DeepSpeed's ``reset``): call it after
    forwards that had no backward, e.g. evaluation with grad enabled. Options stay."""
    SETTINGS.buffers.clear()


def set_num_layers(nlayers: int) -> None:
    """Set ``number_checkpoints`` (the contiguous buffers' slots; buffers being filled are
    dropped, as their layout changes)."""
    SETTINGS.num_checkpoints = nlayers
    SETTINGS.buffers.clear()


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Switch ``partition_activations`` on or off, keeping the other options."""
    SETTINGS.partition_activations = bool(partition_activation)
    SETTINGS.connect()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's RNG tracker (Megatron's ``get_cuda_rng_tracker``)."""
    return TRACKER


def model_parallel_cuda_manual_seed(seed: int, *, tensor_rank: int | None = None) -> None:
    """Seed the default generator with ``seed`` and the tracker's model-parallel state with
    ``seed + 2718 + tensor_rank``: dropout inside ``get_cuda_rng_tracker().fork()`` differs
    across tensor ranks, outside it is the same on all of them.

    Args:
        seed: the base seed (the same on every rank of a tensor group).
        tensor_rank: this rank's tensor-parallel index; None takes it from the mpu given
            to ``configure`` (0 without one).
    """
    rank = SETTINGS.tensor_rank() if tensor_rank is None else tensor_rank
    seed_model_parallel(seed, tensor_rank=rank)
    logger.debug(
        "model-parallel RNG: default seed %d, tracker seed %d (tensor rank %d)",
        seed,
        seed + TENSOR_SEED_OFFSET + rank,
        rank,
    )


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Reseed only the tracker's model-parallel state with ``seed + 2718 + tensor rank``."""
    with TRACKER.fork(MODEL_PARALLEL_RNG):
        get_accelerator().manual_seed(seed + TENSOR_SEED_OFFSET + SETTINGS.tensor_rank())


def checkpoint(function, *args, **kwargs):
    """``function(*args, **kwargs)`` whose activations are recomputed in backward.

    Outputs and gradients equal the un-checkpointed call's (every random stream is
    replayed, the tracker's named states included). Only the inputs are kept between
    forward and backward, stored as ``configure`` set (see [Note: partitioned
    activations]); tensors passed by keyword take part in autograd like positional ones.
    Reentrant, as DeepSpeed's: the parameters get gradients only if some tensor input
    requires grad (else use ``non_reentrant_checkpoint``). Under ``torch.no_grad()`` the
    function just runs and nothing is stored.
    """
    if kwargs:
        names, positional = tuple(kwargs), len(args)

        def call(*values, run=function):
            return run(*values[:positional], **dict(zip(names, values[positional:])))

        function, args = call, args + tuple(kwargs.values())
    if not torch.is_grad_enabled():
        return function(*args)
    if not any(torch.is_tensor(a) and a.requires_grad for a in args):
        warnings.warn(
            "deepspeed.checkpointing.checkpoint: no input tensor requires grad, so the checkpointed "
            "block's parameters get no gradients; make an input require grad (Hugging Face: "
            "model.enable_input_require_grads()) or use non_reentrant_checkpoint",
            stacklevel=2,
        )
    return CheckpointFunction.apply(function, SETTINGS.options(), *args)


def non_reentrant_checkpoint(function, *args):
    """``checkpoint`` without re-entering autograd (``torch.utils.checkpoint``'s
    non-reentrant form): parameters get gradients even when no input requires grad.
    It keeps inputs as they are, so it refuses partition_activations and
    cpu_checkpointing, and warns that synchronize and profile do not apply to it."""
    asked = [
        name
        for name, on in (
            ("partition_activations", SETTINGS.tensor_comm is not None),
            ("cpu_checkpointing", SETTINGS.cpu_checkpointing),
        )
        if on
    ]
    if asked:
        raise NotImplementedError(
            f"non_reentrant_checkpoint does not apply {' and '.join(asked)}; use "
            "deepspeed.checkpointing.checkpoint (reentrant), which does"
        )
    if SETTINGS.synchronize or SETTINGS.profile:
        warnings.warn(
            "non_reentrant_checkpoint does not synchronize or profile at checkpoint boundaries; "
            "deepspeed.checkpointing.checkpoint does",
            stacklevel=2,
        )
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
