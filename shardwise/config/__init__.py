"""Typed configs and the adapter that reads DeepSpeed-style JSON. Pure Python."""

from shardwise.config._components import (
    ActivationCheckpointingConfig,
    AioConfig,
    BatchConfig,
    BF16Config,
    CheckpointConfig,
    CommConfig,
    DataTypesConfig,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from shardwise.config._errors import ConfigError
from shardwise.config._train import TrainConfig
from shardwise.config.from_dict import activation_checkpointing_config, load_config, resolve_batch

__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "BF16Config",
    "BatchConfig",
    "CheckpointConfig",
    "CommConfig",
    "ConfigError",
    "DataTypesConfig",
    "FP16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainConfig",
    "ZeroConfig",
    "activation_checkpointing_config",
    "load_config",
    "resolve_batch",
]
