"""The ``tensor_parallel`` section: training AutoTP's settings, DeepSpeed's keys."""

from __future__ import annotations

import logging
from typing import Any

from shardwise.config._errors import ConfigError, check_keys

logger = logging.getLogger("shardwise")

SECTION_KEYS = {
    "autotp_size",
    "tp_overlap_comm",
    "tp",
    "tensor_parallel",
    "injection_policy_tuple",
    "partition_config",
    "preset_model",
    "keep_module_on_host",
    "replace_with_kernel_inject",
    "kernel_inject",
    "dtype",
}


def check_tensor_parallel(section: Any) -> int:
    """Validate a ``tensor_parallel`` section and return its ``autotp_size`` (0 and 1: no
    tensor parallelism). What cannot be honoured is refused by name."""
    if section is None:
        return 0
    check_keys("tensor_parallel", section, SECTION_KEYS)
    size = section.get("autotp_size", 0)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ConfigError(f"tensor_parallel.autotp_size must be a non-negative integer, got {size!r}")
    inner = section.get("tp", section.get("tensor_parallel")) or {}
    check_keys("tensor_parallel.tp", inner, {"tp_size", "tp_grain_size", "mpu", "tp_group"})
    if inner.get("tp_size", 1) not in (1, size):
        raise ConfigError(
            f"tensor_parallel.tp.tp_size ({inner['tp_size']}) does not match "
            f"tensor_parallel.autotp_size ({size}); set one of them"
        )
    if inner.get("tp_grain_size", 1) != 1:
        raise ConfigError(
            f"tensor_parallel.tp.tp_grain_size={inner['tp_grain_size']!r}: uneven splits are not "
            "available in this version of shardwise; remove it (layers split evenly)"
        )
    if section.get("injection_policy_tuple") is not None:
        raise ConfigError(
            "tensor_parallel.injection_policy_tuple cannot come from a JSON config; name the "
            "layers with tensor_parallel.partition_config.layer_specs"
        )
    if section.get("replace_with_kernel_inject") or section.get("kernel_inject"):
        raise ConfigError(
            "tensor_parallel.replace_with_kernel_inject is an inference option "
            "(shardwise.init_inference); remove it from a training config"
        )
    no_effect = [key for key in ("tp_overlap_comm", "keep_module_on_host") if section.get(key)]
    if no_effect:
        logger.warning(
            "tensor_parallel.%s: no effect in this version of shardwise (the tensor-parallel "
            "all-reduces are not overlapped with compute; the model is split where it is)",
            " and ".join(no_effect),
        )
    partition = section.get("partition_config")
    if partition is not None:
        check_keys("tensor_parallel.partition_config", partition, {"use_default_specs", "layer_specs"})
    return size
