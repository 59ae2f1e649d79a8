"""DeepSpeed config sections owned by features not built yet.

Each is recognised (so it is not reported as a misspelling) and type-checked; a section
that switches on a feature this version lacks is refused with an error naming it,
never silently ignored. Sections that only tune a feature which is off are accepted.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from shardwise.config._compression import compression_config
from shardwise.config._errors import ConfigError, check_keys
from shardwise.config._expert_parallel import check_expert_parallel
from shardwise.config._pipeline import check_pipeline
from shardwise.config._sparse_attention import sparse_attention_section
from shardwise.config._tensor_parallel import check_tensor_parallel

logger = logging.getLogger("shardwise")

# section -> allowed keys (None: any keys; the section is validated as an object only)
LATER_SECTIONS: dict[str, set[str] | None] = {
    "amp": None,
    "pipeline": None,
    "sparse_attention": None,
    "compression_training": None,
    "elasticity": None,
    "nebula": None,
    "eigenvalue": None,
    "quantize_training": None,
    "torch_autocast": None,
    "compile": None,
    "timers": None,
    "tensor_parallel": None,
    "weight_quantization": None,
    "expert_parallel": None,
}
"""Top-level DeepSpeed sections that later shardwise features own."""

LATER_SCALARS = {
    "sparse_gradients",
    "graph_harvesting",
    "sequence_parallel_size",
    "seq_parallel_communication_data_type",
    "use_data_before_expert_parallelism",
    "memory_breakpoint_",
    "zero_quantized_weights",
}
"""Top-level scalar keys of later features."""

_NAMES = {
    "amp": 'NVIDIA Apex AMP (use "fp16" or "bf16" instead)',
    "elasticity": "elastic training",
    "nebula": "Nebula checkpointing",
    "eigenvalue": "eigenvalue computation",
    "quantize_training": "quantized training",
    "torch_autocast": "torch autocast",
    "compile": "DeepCompile (torch.compile integration)",
    "weight_quantization": "weight quantization",
    "expert_parallel": "expert parallelism (AutoEP)",
}
_ON_BY_DEFAULT = {"weight_quantization"}  # DeepSpeed enables it when the section is present


# sections switched on by a key other than "enabled": section -> (key, values that leave it off)
_SWITCHES = {"compile": ("deepcompile", (False,))}


def _not_available(feature: str, key: str) -> ConfigError:
    return ConfigError(
        f"{feature} ('{key}') is not available in this version of shardwise yet; "
        f"remove the '{key}' section or set its \"enabled\" to false"
    )


def check_later_section(key: str, value: Any) -> None:
    """Validate one later-feature section and refuse it if it switches the feature on."""
    allowed = LATER_SECTIONS[key]
    if not isinstance(value, dict):
        raise ConfigError(f"'{key}' must be a JSON object, got {value!r}")
    if allowed is not None:
        check_keys(key, value, allowed)
    if key == "tensor_parallel":  # built: training AutoTP (tensor_parallel/autotp.py)
        check_tensor_parallel(value)
        return
    if key == "sparse_attention":  # built: the model reads it (ops/sparse_attention)
        sparse_attention_section(value)
        return
    if key == "pipeline":  # built: the pipeline engine (pipe/engine.py) reads it
        check_pipeline(value)
        return
    if key == "expert_parallel":  # built: AutoEP (moe/_autoep.py)
        check_expert_parallel(value)
        return
    if key == "compression_training":  # built: shardwise/compression (the rest refused by name)
        compression_config(value)
        return
    if key in _SWITCHES:
        switch, off = _SWITCHES[key]
        if value.get(switch, off[0]) not in off:
            raise ConfigError(
                f"{_NAMES[key]} ('{key}.{switch}'={value[switch]!r}) is not available in this "
                f"version of shardwise yet; remove the '{key}' section or set {switch} to "
                f"{json.dumps(off[0])}"
            )
        return
    enabled = value.get("enabled", key in _ON_BY_DEFAULT)
    if enabled not in (True, False, "auto"):
        raise ConfigError(f"{key}.enabled must be true or false, got {enabled!r}")
    if enabled is True:
        raise _not_available(_NAMES.get(key, key), key)


def check_later_scalar(key: str, value: Any) -> None:
    """Refuse a later-feature scalar that is switched on."""
    if key == "sparse_gradients" and value:
        raise ConfigError(
            "sparse_gradients=true is not available in this version of shardwise "
            "yet; remove it (embedding gradients are reduced densely)"
        )
    if key == "graph_harvesting" and value:
        raise ConfigError(
            "graph_harvesting=true (CUDA-graph capture of DeepSpeed's kernels) is not available "
            "in this version of shardwise yet; remove it"
        )
    if key == "use_data_before_expert_parallelism" and not isinstance(value, bool):
        raise ConfigError(f"use_data_before_expert_parallelism must be true or false, got {value!r}")
    if key == "sequence_parallel_size" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(
            f"sequence_parallel_size must be a positive integer (the ranks that split one sequence), got {value!r}"
        )


def check_sequence_parallel_size(value) -> None:
    """``sequence_parallel_size`` must be a positive integer."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(
            f"sequence_parallel_size must be a positive integer (the ranks that split one sequence), got {value!r}"
        )
