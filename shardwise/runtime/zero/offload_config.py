"""DeepSpeed's offload enums: where state is offloaded, and which state ``offload_states`` moves."""

from __future__ import annotations

from enum import Enum

from shardwise.config._components import OffloadOptimizerConfig, OffloadParamConfig

DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig


class OffloadDeviceEnum(str, Enum):
    """Where offloaded state lives."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The kinds of state ``engine.offload_states(include=...)`` moves off the device."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]
