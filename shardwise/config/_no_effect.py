"""DeepSpeed keys that shardwise accepts without acting on them, and keys that may only
stay off.

[Note: keys with no effect]
Every key of DeepSpeed's config schema loads. Keys the dataclasses use mean what they
mean in DeepSpeed. The rest fall in two tables here:

- NO_EFFECT: knobs whose behaviour shardwise always has or does not need (overlapping,
  bucketing, debug switches of DeepSpeed's own kernels). They are type-checked and named
  in one warning per load (rank 0), never dropped silently.
- UNBUILT: switches of features this version lacks. Off (the listed values) they are
  accepted without a word, since off is what shardwise does; on they are refused with an
  error naming the feature. In "fp16" and "bf16" they only count while the section is
  enabled (a disabled section asks for nothing).

Keys that ``shardwise.zero.build_strategy`` reports itself, knowing the stage
(overlap_comm, contiguous_gradients, reduce_scatter, allgather_partitions,
allgather_bucket_size, stage3_module_granularity_threshold), are not listed here, so no
key is reported twice.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from shardwise.config._errors import AUTO, ConfigError, as_bool, as_int, as_number, check_keys

logger = logging.getLogger("shardwise")

_WRITER_KEYS = frozenset(
    {"type", "io_buffer_size", "io_buffer_double", "show_statistics", "data_parallel", "decoupled", "io_multiplier"}
)
_LEAF_KEYS = frozenset({"classes", "names", "name_suffixes"})
_LOCO_KEYS = frozenset({"err_beta", "reset_T"})
_ZENFLOW_KEYS = frozenset(
    {
        "topk_ratio",
        "select_strategy",
        "select_interval",
        "update_interval",
        "overlap_step",
        "offload",
        "auto_ratio",
        "full_warm_up_rounds",
        "pt_reserved_cores_perc",
        "steps_per_epoch",
    }
)

# path -> key -> (kind, why it has no effect). A kind is "bool", "int", "number", "str",
# "list", "object" (a trailing "?" allows null) or a frozenset: an object with those keys.
NO_EFFECT: dict[str, dict[str, tuple[Any, str]]] = {
    "": {
        "dump_state": ("bool", "the resolved config is not printed"),
        "disable_allgather": ("bool", "updated shards are always all-gathered"),
        "zero_force_ds_cpu_optimizer": ("bool", "offloaded steps always run torch's fused CPU kernels"),
        "zero_allow_untested_optimizer": ("bool", "client optimizers are always allowed"),
        "log_level": ("str?", 'set logging.getLogger("shardwise").setLevel instead'),
        "seq_parallel_communication_data_type": ("str?", "sequence parallelism is not available"),
    },
    "zero_optimization": {
        "round_robin_gradients": ("bool", "an offload copy-order optimisation"),
        # documented by DeepSpeed though its ZeRO config class no longer reads it
        "grad_hooks": ("bool", "gradients are always reduced from backward hooks"),
        "ignore_unused_parameters": ("bool", "parameters without gradients are always tolerated"),
        "load_from_fp32_weights": ("bool", "checkpoints always restore the fp32 master weights"),
        "elastic_checkpoint": ("bool", "checkpoints load under any stage and world size"),
        "legacy_stage1": ("bool", "there is one stage-1 implementation"),
        "memory_efficient_linear": ("bool", "no torch.nn.functional.linear replacement is needed"),
        "use_multi_rank_bucket_allreduce": ("bool", "gradients are reduce-scattered per bucket"),
        "round_robin": ("bool", "an offload copy-order optimisation"),
        "log_trace_cache_warnings": ("bool", "the module order is recorded without a trace cache"),
        "stage3_model_persistence_threshold": (
            "int",
            "every parameter under stage3_param_persistence_threshold stays whole; lower that instead",
        ),
        "stage3_use_all_reduce_for_fetch_params": ("bool", "parameters are always all-gathered"),
        "stage3_allgather_sequential": ("bool", "all-gathers are grouped by module"),
        "cpu_offload_use_pin_memory": ("bool?", "deprecated by DeepSpeed; use offload_*.pin_memory"),
        "pipeline_loading_checkpoint": ("bool", "pipeline parallelism is not available"),
        "override_module_apply": (
            "bool",
            "nn.Module.apply is never patched; gather with shardwise.zero.GatheredParameters",
        ),
        "enable_sanity_checks": ("bool", "DeepSpeed's internal debug checks"),
        "save_muon_momentum_buffer_in_memory": ("bool", "the Muon optimizer is not available"),
        "zeropp_loco_param": (_LOCO_KEYS, "tunes ZeRO++ quantized gradients, which are off"),
        "leaf_module": (_LEAF_KEYS, "units are always one module's own parameters"),
    },
    "zero_optimization.offload_optimizer": {
        "pipeline_read": ("bool", "swap-file reads always overlap the step"),
        "pipeline_write": ("bool", "swap-file writes always overlap the step"),
        "fast_init": ("bool", "swap files are created empty and filled on first write"),
        "cpuadam_cores_perc": ("number", "torch's CPU kernels use torch's thread count"),
    },
    "aio": {
        "single_submit": ("bool", "requests are submitted by the I/O threads"),
        "overlap_events": ("bool", "submission and completion always overlap"),
    },
    "bf16": {
        "immediate_grad_update": ("bool", "gradients are applied at the step"),
    },
    "checkpoint": {
        "load_universal": ("bool", "every shardwise checkpoint loads under any layout"),
        "checkpoint_serialization": ("bool", "shardwise writes its own checkpoint format"),
        "writer": (_WRITER_KEYS, "checkpoints are written with torch.save"),
    },
}
"""Keys accepted with one warning naming them; see [Note: keys with no effect]."""

# path -> key -> (kind, accepted values, the feature a different value asks for)
UNBUILT: dict[str, dict[str, tuple[Any, tuple, str]]] = {
    "": {
        "managed_gradient_accumulation": ("bool", (True,), "client-managed accumulation boundaries"),
        "gradient_allreduce_op": ("str", ("mean",), "summed (unaveraged) gradients"),
        "datastates_ckpt": ("any", (False, None), "DataStates asynchronous checkpointing"),
    },
    "zero_optimization": {
        "zero_hpz_partition_size": ("int", (0, 1), "ZeRO++ hierarchical partitioning (hpZ)"),
        "zero_quantized_weights": ("bool", (False,), "ZeRO++ quantized weights (qwZ)"),
        "zero_quantized_nontrainable_weights": ("bool", (False,), "ZeRO++ quantized frozen weights"),
        "zero_quantized_gradients": ("bool", (False,), "ZeRO++ quantized gradients (qgZ)"),
        "mics_shard_size": ("int", (-1, 0), "MiCS sub-group sharding"),
        "mics_hierarchical_params_gather": ("bool", (False,), "MiCS hierarchical all-gather"),
        "zenflow": (_ZENFLOW_KEYS, (None,), "ZenFlow (asynchronous offloaded updates)"),
    },
    "zero_optimization.offload_optimizer": {
        "super_offload": ("bool", (False,), "SuperOffload for superchips"),
    },
    "fp16": {
        "fp16_master_weights_and_grads": (
            "bool",
            (False,),
            "fp16 master weights and gradients (shardwise keeps fp32 master weights)",
        ),
    },
    "bf16": {
        "bf16_master_weights_and_grads": (
            "bool",
            (False,),
            "bf16 master weights and gradients (shardwise keeps fp32 master weights)",
        ),
        "bf16_optimizer_states": ("bool", (False,), "bf16 optimizer states (shardwise keeps them in fp32)"),
    },
}
"""Keys of unbuilt features: accepted off, refused on; see [Note: keys with no effect]."""


def known_keys(path: str) -> set[str]:
    """The keys of ``path`` that the two tables own."""
    return set(NO_EFFECT.get(path, {})) | set(UNBUILT.get(path, {}))


def _check_kind(full: str, kind: Any, value: Any) -> None:
    if value == AUTO or kind == "any":
        return
    if isinstance(kind, frozenset):
        if value is not None:
            check_keys(full, value, kind)
        return
    if kind.endswith("?"):
        if value is None:
            return
        kind = kind[:-1]
    if kind == "bool":
        as_bool(full, value)
    elif kind == "int":
        as_int(full, value)
    elif kind == "number":
        as_number(full, value)
    elif kind == "str" and not isinstance(value, str):
        raise ConfigError(f"{full} must be a string, got {value!r}")


def take_special_keys(path: str, section: dict, noted: list[str], *, enabled: bool = True) -> None:
    """Check the ``section`` keys of both tables; refuse unbuilt features that are on and
    add each no-effect key to ``noted``.

    ``enabled`` is False for an fp16/bf16 section that is switched off: its unbuilt keys
    then ask for nothing.
    """
    prefix = f"{path}." if path else ""
    for key, (kind, why) in NO_EFFECT.get(path, {}).items():
        if key in section:
            _check_kind(prefix + key, kind, section[key])
            noted.append(f"{prefix}{key} ({why})")
    for key, (kind, accepted, feature) in UNBUILT.get(path, {}).items():
        if key not in section:
            continue
        value = section[key]
        _check_kind(prefix + key, kind, value)
        if enabled and value not in accepted and value != AUTO:
            raise ConfigError(
                f"{prefix}{key}={json.dumps(value)} asks for {feature}, which is not available "
                f"in this version of shardwise; remove it or set it to {json.dumps(accepted[0])}"
            )


def _is_rank0() -> bool:
    # torch is not imported here: the config package stays pure Python.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def log_no_effect(noted: list[str]) -> None:
    """One warning (rank 0) naming every no-effect key of one load."""
    if noted and _is_rank0():
        logger.warning("config keys with no effect in this version of shardwise: %s", "; ".join(noted))
