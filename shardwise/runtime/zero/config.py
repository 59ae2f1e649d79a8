"""DeepSpeed's names for the ``zero_optimization`` section's config class and stages."""

from enum import IntEnum

from shardwise.config._components import ZeroConfig

DeepSpeedZeroConfig = ZeroConfig


class ZeroStageEnum(IntEnum):
    """ZeRO stages by name."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


__all__ = ["DeepSpeedZeroConfig", "ZeroStageEnum"]
