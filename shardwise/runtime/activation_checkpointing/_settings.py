"""The options ``deepspeed.checkpointing.configure`` sets, in one object.

DeepSpeed's activation-checkpointing API is module-level (``configure`` once, then
``checkpoint`` anywhere), so its options are process state. They live in the single
:data:`SETTINGS` object below rather than in a dozen globals; ``configure`` fills it,
every ``checkpoint`` call reads a frozen snapshot of it (:meth:`CheckpointSettings.options`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from shardwise.comm import Communicator
from shardwise.config import CommConfig
from shardwise.runtime.activation_checkpointing._function import CallOptions
from shardwise.runtime.activation_checkpointing._saved_inputs import ContiguousBuffers, StoragePolicy
from shardwise.utils._logging import log_dist


def tensor_group_of(mpu: Any) -> tuple[Any, int, int]:
    """``(group, rank, world size)`` of the tensor-parallel group of a Megatron-style
    ``mpu`` (``get_tensor_model_parallel_*``, or the older ``get_model_parallel_*``)."""
    prefix = "get_tensor_model_parallel_" if hasattr(mpu, "get_tensor_model_parallel_group") else "get_model_parallel_"
    missing = [name for name in ("group", "rank", "world_size") if not hasattr(mpu, prefix + name)]
    if missing:
        raise TypeError(
            f"mpu_ must have get_tensor_model_parallel_group/rank/world_size (or "
            f"get_model_parallel_group/rank/world_size); {type(mpu).__name__} lacks "
            + ", ".join(prefix + name for name in missing)
        )
    return (
        getattr(mpu, prefix + "group")(),
        int(getattr(mpu, prefix + "rank")()),
        int(getattr(mpu, prefix + "world_size")()),
    )


@dataclass
class CheckpointSettings:
    """What ``configure`` set; the defaults are DeepSpeed's (plain recompute)."""

    configured: bool = False
    """Whether ``configure`` has run (``is_configured()``)."""
    mpu: Any = None
    """The Megatron-style model-parallel object (None: no tensor parallelism)."""
    partition_activations: bool = False
    """See [Note: partitioned activations]."""
    cpu_checkpointing: bool = False
    """Keep stored inputs in host memory."""
    contiguous_memory_optimization: bool = False
    """Store partitions in one preallocated buffer per input position."""
    num_checkpoints: int | None = None
    """Slots of those buffers (checkpoint calls per forward)."""
    synchronize: bool = False
    """Synchronize the device at each checkpoint boundary."""
    profile: bool = False
    """Log each checkpoint's forward and backward time."""
    comm_timeout_s: float = CommConfig.timeout_s
    """Deadline of the partition all-gathers (the config's ``comm.timeout_s``)."""
    tensor_comm: Communicator | None = None
    """The tensor-parallel group's communicator (built when partitions are gathered)."""
    buffers: ContiguousBuffers = field(default_factory=ContiguousBuffers)
    """The contiguous buffers being filled (state, not an option: ``reset()`` clears it)."""

    def reset(self) -> None:
        """Back to the defaults (unconfigured)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)

    def tensor_rank(self) -> int:
        """This rank's index in the tensor-parallel group (0 without an ``mpu``)."""
        return 0 if self.mpu is None else tensor_group_of(self.mpu)[1]

    def connect(self) -> None:
        """Build the tensor-parallel communicator if partitions will be gathered, and say
        when partitioning has nothing to divide."""
        self.tensor_comm = None
        if not self.partition_activations:
            return
        if self.mpu is None:  # issue 15: "partition_activations without a tensor group" is an error
            self.partition_activations = False
            raise ValueError(
                "activation checkpointing: partition_activations=True needs a tensor-parallel group to "
                "split the checkpointed inputs across; pass mpu_ (your Megatron mpu, or engine.grid) to "
                "shardwise.checkpointing.configure(), or set partition_activations to false"
            )
        group, _, world_size = tensor_group_of(self.mpu)
        if world_size > 1:
            self.tensor_comm = Communicator(
                group, timeout_s=self.comm_timeout_s, name="tensor-parallel", shared_memory=True
            )
            return
        where = "a tensor-parallel group of 1 rank"
        layout = (
            ", and contiguous_memory_optimization has no partitions to lay out"
            if self.contiguous_memory_optimization
            else ""
        )
        log_dist(
            f"activation checkpointing: partition_activations=True with {where}: each rank keeps its "
            f"checkpointed inputs whole, as DeepSpeed does (nothing to divide{layout}); pass an mpu_ whose "
            "tensor-parallel world size is > 1 to configure() to partition them",
            ranks=[0],
            level=logging.WARNING,
        )

    def options(self) -> CallOptions:
        """The snapshot one ``checkpoint`` call runs with."""
        contiguous = self.contiguous_memory_optimization and self.tensor_comm is not None
        storage = StoragePolicy(
            tensor_comm=self.tensor_comm,
            host=self.cpu_checkpointing,
            buffers=self.buffers if contiguous else None,
            num_slots=self.num_checkpoints or 0,
        )
        return CallOptions(storage=storage, synchronize=self.synchronize, profile=self.profile)


SETTINGS = CheckpointSettings()
"""The process's activation-checkpointing options (see the module docstring)."""
