"""The top-level config: it only nests the component configs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardwise.config._autotuning import AutotuningConfig
from shardwise.config._components import (
    ONEBIT_OPTIMIZERS,
    ONEBIT_ZERO_REFUSAL,
    ActivationCheckpointingConfig,
    AioConfig,
    BatchConfig,
    BF16Config,
    CheckpointConfig,
    CommConfig,
    DataTypesConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from shardwise.config._compression import CompressionConfig
from shardwise.config._data_efficiency import DataEfficiencyConfig, LegacyCurriculumConfig, ProgressiveLayerDropConfig
from shardwise.config._errors import ConfigError, as_bool, as_choice, as_int, as_number
from shardwise.config._hybrid_engine import HybridEngineConfig
from shardwise.config._monitor import MonitorConfig


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``initialize()`` needs, validated; built by :func:`load_config`."""

    batch: BatchConfig
    """The resolved batch-size triangle."""
    optimizer: OptimizerConfig | None = None
    """The optimizer to build (None: the client passes one, or none is needed)."""
    scheduler: SchedulerConfig | None = None
    """The LR schedule to build (None: constant, or the client's)."""
    fp16: FP16Config = field(default_factory=FP16Config)
    """fp16 mixed precision."""
    bf16: BF16Config = field(default_factory=BF16Config)
    """bf16 mixed precision."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO partitioning."""
    gradient_clipping: float = 1.0
    """Clip gradients to this global norm (0: no clipping). 1.0 when not set, as in DeepSpeed
    0.19.8 (older DeepSpeed releases did not clip by default)."""
    steps_per_print: int | None = None
    """Print a progress line every this many optimizer steps (None, DeepSpeed 0.19.8's
    default: never)."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step (synchronising the device) and print the split."""
    prescale_gradients: bool = False
    """Divide gradients by the rank count before the all-reduce instead of after."""
    gradient_predivide_factor: float = 1.0
    """Divide gradients by this before the all-reduce and by ranks/factor after."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint behaviour."""
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)
    """Buffer dtypes."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Collective deadlines (shardwise extension)."""
    aio: AioConfig = field(default_factory=AioConfig)
    """Swap-file I/O for the nvme offload tier."""
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    """What ``deepspeed.checkpointing.checkpoint`` stores (read by ``checkpointing.configure``)."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """Monitors (TensorBoard, CSV, W&B, Comet), the FLOPs profiler, the communication logger
    and the memory breakdown."""
    hybrid_engine: HybridEngineConfig = field(default_factory=HybridEngineConfig)
    """The Hybrid Engine (generation with the training weights); off unless enabled."""
    curriculum_learning: LegacyCurriculumConfig = field(default_factory=LegacyCurriculumConfig)
    """The legacy sequence-length curriculum (``curriculum_seqlen`` passed to the forward)."""
    progressive_layer_drop: ProgressiveLayerDropConfig = field(default_factory=ProgressiveLayerDropConfig)
    """Progressive layer drop (``pld_theta`` passed to the forward)."""
    data_efficiency: DataEfficiencyConfig = field(default_factory=DataEfficiencyConfig)
    """DeepSpeed's data-efficiency library: random-LTD (driven by the engine's training
    features), curriculum data sampling (the engine's loader) and dynamic batching."""
    compression_training: CompressionConfig = field(default_factory=CompressionConfig)
    """Compression (QAT, pruning): which techniques the engine's compression scheduler
    advances; ``shardwise.compression.compress.init_compression`` replaces the layers."""
    autotuning: AutotuningConfig = field(default_factory=AutotuningConfig)
    """The autotuner's search (``shardwise run --autotuning``) and, inside one of its
    experiments, the profiled window after which the engine exits."""
    communication_data_type: str | None = None
    """dtype of gradient collectives (None: the gradient dtype)."""
    dump_state: bool = False
    """Print the resolved config at start-up."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete micro-batch of the loader initialize() returns."""
    zero_allow_untested_optimizer: bool = False
    """Allow client optimizers with ZeRO."""
    zero_force_ds_cpu_optimizer: bool = True
    """Accepted for compatibility (offload)."""
    memory_breakpoint: bool = False
    """Accepted for compatibility."""
    disable_allgather: bool = False
    """Accepted for compatibility."""
    raw: Mapping[str, Any] = field(default_factory=dict)
    """The config as given (after legacy-name mapping), for components built later."""

    def __post_init__(self) -> None:
        as_number("gradient_clipping", self.gradient_clipping, minimum=0)
        if self.steps_per_print is not None:
            as_int("steps_per_print", self.steps_per_print, minimum=1)
        as_number("gradient_predivide_factor", self.gradient_predivide_factor, minimum=0, strict=True)
        for name in (
            "wall_clock_breakdown",
            "prescale_gradients",
            "dump_state",
            "dataloader_drop_last",
            "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer",
            "memory_breakpoint",
            "disable_allgather",
        ):
            as_bool(name, getattr(self, name))
        if self.communication_data_type is not None:
            as_choice("communication_data_type", self.communication_data_type, ("fp32", "fp16", "bf16"))
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one of them")
        mode = "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"
        if self.data_types.param_dtype not in (None, mode):
            raise ConfigError(
                f"data_types.param_dtype={self.data_types.param_dtype!r} differs from the training "
                f"dtype the fp16/bf16 sections select ({mode}); remove data_types.param_dtype or "
                "enable the matching section"
            )
        if self.optimizer is not None and self.optimizer.type in ONEBIT_OPTIMIZERS and self.zero.stage > 0:
            raise ConfigError(
                ONEBIT_ZERO_REFUSAL.format(name=f"optimizer.type {self.optimizer.type!r}", stage=self.zero.stage)
            )
        if self.prescale_gradients and self.gradient_predivide_factor != 1.0:
            raise ConfigError("prescale_gradients=true and gradient_predivide_factor != 1 conflict; use one of them")
