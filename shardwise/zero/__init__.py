"""ZeRO: how parameters, gradients and optimizer states are held across data-parallel ranks.

Glossary (used with these meanings throughout the package):
- *original param*: the ``nn.Parameter`` the user's module was built with.
- *master param*: the fp32 copy the optimizer updates when the module computes in
  fp16/bf16.
- *sharded param* / *unsharded param*: a rank's slice of a parameter / the full tensor
  gathered from every rank's slice (stage 3).
- *grad shard*: the slice of a reduced gradient a rank owns (stages 2 and 3).
- *bucket*: a flat buffer holding several gradients that are reduced by one collective.
- *unit* (stage 3): the bucket of the parameters one module owns in one param group,
  gathered and freed together; its states are ``_unit.UnitState``.
- *gatherer*: the object a sharded strategy holds that decides when parameters are whole
  (``_gatherer.py``: every bucket after the step at stages 1-2, each unit around its
  module's forward and backward at stage 3).

Stages are implementations of :class:`ZeroStrategy` (the step) and hold their state and
checkpoint views as ``strategy.views`` (:class:`ZeroViews`, ``_views.py``); the engine calls
only those interfaces.
"""

from __future__ import annotations

import logging

import torch

from shardwise.moe._bind import expert_comms
from shardwise.zero._gathered import GatheredParameters, register_external_parameter
from shardwise.zero._init import Init, load_state_dict, materialize
from shardwise.zero._leaf import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from shardwise.zero._param_state import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
)
from shardwise.zero._sharded import ShardedStrategy
from shardwise.zero._stage0 import Stage0Strategy
from shardwise.zero._stage3 import Stage3Strategy
from shardwise.zero._strategy import ModelParallel, ModelStateBytes, StepResult, ZeroStrategy, ZeroViews

logger = logging.getLogger("shardwise")

__all__ = [
    "GatheredParameters",
    "Init",
    "load_state_dict",
    "materialize",
    "ModelStateBytes",
    "ShardedStrategy",
    "Stage0Strategy",
    "Stage3Strategy",
    "StepResult",
    "ZeroStrategy",
    "ZeroViews",
    "build_strategy",
    "get_z3_leaf_modules",
    "register_external_parameter",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]

DEFAULT_DP_BUCKET_BYTES = 25 * 1024 * 1024
"""Gradient bucket size for stage 0 when the config does not set reduce_bucket_size.

DeepSpeed's default (5e8 elements) puts a whole model in one bucket, which defeats
overlapping the all-reduce with backward; 25 MiB buckets (PyTorch DDP's choice) overlap."""


def _refuse_unbuilt(config, policy) -> None:
    """Settings this version reads but cannot honour yet are errors, never ignored."""
    zero = config.zero
    names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    for key, value in (
        ("data_types.grad_accum_dtype", config.data_types.grad_accum_dtype),
        ("communication_data_type", config.communication_data_type),
    ):
        if value is not None and names[value] != policy.param_dtype:
            raise NotImplementedError(
                f"{key}={value!r} differs from the training dtype ({policy.param_dtype}); "
                "gradients are accumulated and reduced in the training dtype in this version of "
                f"shardwise; remove {key}"
            )
    if config.checkpoint.use_node_local_storage or config.checkpoint.parallel_write:
        raise NotImplementedError(
            "checkpoint.use_node_local_storage and checkpoint.parallel_write are "
            "not available in this version of shardwise yet; remove them "
            "(checkpoints go to the shared save_dir)"
        )
    if zero.stage > 0 and config.optimizer is not None and config.optimizer.type == "lamb":
        raise NotImplementedError(
            f"the Lamb optimizer needs whole parameters for its trust ratio and cannot run on ZeRO "
            f"stage {zero.stage}'s flat shards yet; use stage 0, or Adam/AdamW/SGD/Adagrad"
        )


def _warn_ignored(config, comm) -> None:
    """Performance switches whose behaviour shardwise always has: say so once."""
    raw = config.raw.get("zero_optimization") or {}
    ignored = [
        key
        for key in ("overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions")
        if raw.get(key) is False
    ]
    if "allgather_bucket_size" in raw and config.zero.stage in (1, 2):
        ignored.append("allgather_bucket_size (parameters are all-gathered per reduce bucket)")
    if config.zero.stage == 3:
        ignored += [key for key in ("stage3_module_granularity_threshold",) if key in raw]
    if ignored and comm.rank == 0:
        logger.warning(
            "zero_optimization settings with no effect in this version of shardwise: %s "
            "(gradients are always reduce-scattered in contiguous buckets overlapped with "
            "backward; stage 3 units are whole modules)",
            ", ".join(ignored),
        )


def build_strategy(module, *, config, comm, policy, grid=None) -> ZeroStrategy:
    """Pick and build the ZeRO strategy ``config.zero`` asks for; ``comm`` is the
    data-parallel communicator, ``grid`` the process grid (None: data parallel only)."""
    zero = config.zero
    _refuse_unbuilt(config, policy)
    _warn_ignored(config, comm)
    user_set = "reduce_bucket_size" in (config.raw.get("zero_optimization") or {})
    element_size = policy.param_dtype.itemsize
    bucket_numel = zero.reduce_bucket_size if user_set else DEFAULT_DP_BUCKET_BYTES // element_size
    predivide = comm.world_size if config.prescale_gradients else config.gradient_predivide_factor
    experts = expert_comms(module, grid)
    offload = dict(
        offload=zero.offload_optimizer,
        aio=config.aio,
        sub_group_size=zero.sub_group_size,
        model_parallel=ModelParallel.from_grid(grid),
    )
    if zero.stage == 3:
        return Stage3Strategy(
            module,
            comm=comm,
            policy=policy,
            bucket_numel=bucket_numel,
            **offload,
            predivide_factor=predivide,
            prefetch_numel=zero.stage3_prefetch_bucket_size,
            max_live_numel=zero.stage3_max_live_parameters,
            param_offload=zero.offload_param,
            max_reuse_distance=zero.stage3_max_reuse_distance,
            persistence_threshold=zero.stage3_param_persistence_threshold,
            expert_comms=experts,
        )
    if zero.stage in (1, 2):
        return ShardedStrategy(
            module,
            comm=comm,
            policy=policy,
            stage=zero.stage,
            **offload,
            bucket_numel=bucket_numel,
            predivide_factor=predivide,
            expert_comms=experts,
        )
    return Stage0Strategy(
        module,
        comm=comm,
        policy=policy,
        bucket_numel=bucket_numel,
        predivide_factor=predivide,
        model_parallel=ModelParallel.from_grid(grid),
        expert_comms=experts,
    )
