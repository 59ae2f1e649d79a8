"""One frozen dataclass per config section; each validates its own fields.

Field names and defaults are DeepSpeed's, so a DeepSpeed JSON section maps onto its
dataclass key for key. JSON enters through ``from_dict.py`` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardwise.config._errors import ConfigError, as_bool, as_choice, as_int, as_number

OPTIMIZERS = ("adam", "adamw", "sgd", "adagrad", "lamb", "lion", "onebitadam", "zerooneadam", "onebitlamb")
ONEBIT_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")
"""The optimizers that exchange data themselves (see ``shardwise/optim/onebit``)."""
ONEBIT_ZERO_REFUSAL = (
    "{name} runs with ZeRO stage 0 only (zero_optimization.stage {stage} was given): after the warm-up every "
    "rank updates its momentum with its own, unreduced gradient and compresses the whole of it, so each "
    "rank needs the full momentum and full parameters; partitioning the optimizer state (stages 1-2) "
    "would then all-gather the updated parameters in full precision every step, more bytes than the "
    "compression saves, and stage 3 and offload partition further still. Set zero_optimization.stage "
    "to 0, or use Adam/LAMB with ZeRO"
)
"""Why ZeRO stages 1-3 refuse the 1-bit optimizers; ``{name}``, ``{stage}`` filled in."""
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """The batch-size triangle, fully resolved."""

    train_batch_size: int
    """Samples per optimizer step across all data-parallel ranks."""
    train_micro_batch_size_per_gpu: int
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int
    """Micro-steps accumulated before each optimizer step."""

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            as_int(name, getattr(self, name), minimum=1)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """``optimizer``: which optimizer the engine builds and its parameters."""

    type: str
    """Canonical lower-case name: adam, adamw, sgd, adagrad, lamb, lion, onebitadam,
    zerooneadam or onebitlamb."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Constructor arguments with DeepSpeed's names (lr, betas, eps, weight_decay, ...)."""

    def __post_init__(self) -> None:
        as_choice("optimizer.type", self.type, OPTIMIZERS)
        p = self.params
        if "lr" in p:
            as_number("optimizer.params.lr", p["lr"], minimum=0)
        if "eps" in p:
            as_number("optimizer.params.eps", p["eps"], minimum=0, strict=True)
        if "weight_decay" in p:
            as_number("optimizer.params.weight_decay", p["weight_decay"], minimum=0)
        if "betas" in p:
            betas = p["betas"]
            if (
                not isinstance(betas, (list, tuple))
                or len(betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
            ):
                raise ConfigError(f"optimizer.params.betas must be two numbers in [0, 1), got {betas!r}")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """``scheduler``: which DeepSpeed LR schedule to build and its parameters."""

    type: str
    """One of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """The schedule's parameters with DeepSpeed's names."""

    def __post_init__(self) -> None:
        as_choice("scheduler.type", self.type, SCHEDULERS, case_insensitive=False)


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    """``fp16``: fp16 compute with fp32 master weights and loss scaling."""

    enabled: bool = False
    """Train in fp16."""
    auto_cast: bool = False
    """Cast floating-point forward inputs to fp16."""
    loss_scale: float = 0.0
    """0 selects dynamic loss scaling; a positive value is a static scale."""
    initial_scale_power: int = 16
    """The dynamic scale starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Overflow-free steps before the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the scale halves."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every overflow-free step."""
    min_loss_scale: float = 1.0
    """The dynamic scale never drops below this."""

    def __post_init__(self) -> None:
        as_bool("fp16.enabled", self.enabled)
        as_bool("fp16.auto_cast", self.auto_cast)
        as_bool("fp16.consecutive_hysteresis", self.consecutive_hysteresis)
        as_number("fp16.loss_scale", self.loss_scale, minimum=0)
        as_int("fp16.initial_scale_power", self.initial_scale_power, minimum=0, maximum=64)
        as_int("fp16.loss_scale_window", self.loss_scale_window, minimum=1)
        as_int("fp16.hysteresis", self.hysteresis, minimum=1)
        as_number("fp16.min_loss_scale", self.min_loss_scale, minimum=0, strict=True)


@dataclass(frozen=True, kw_only=True)
class BF16Config:
    """``bf16``: bf16 compute with fp32 master weights."""

    enabled: bool = False
    """Train in bf16."""
    immediate_grad_update: bool = False
    """Accepted for compatibility; gradients are always applied at the step."""
    check_grad_overflow: bool = True
    """Skip a step whose gradients are not finite (inf/nan) instead of applying it."""

    def __post_init__(self) -> None:
        as_bool("bf16.enabled", self.enabled)
        as_bool("bf16.immediate_grad_update", self.immediate_grad_update)
        as_bool("bf16.check_grad_overflow", self.check_grad_overflow)


_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _check_offload_common(path: str, cfg) -> None:
    object.__setattr__(cfg, "device", as_choice(f"{path}.device", cfg.device, _OFFLOAD_DEVICES))
    if not isinstance(cfg.nvme_path, str) or not cfg.nvme_path:
        raise ConfigError(f"{path}.nvme_path must be a directory path (a string), got {cfg.nvme_path!r}")
    as_int(f"{path}.buffer_count", cfg.buffer_count, minimum=1)
    as_bool(f"{path}.pin_memory", cfg.pin_memory)


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: where the optimizer states (and the fp32
    master weights and gradient shards the optimizer reads) live (stages 1-3)."""

    device: str = "none"
    """none: with the model; cpu: CPU memory; nvme: files under nvme_path."""
    nvme_path: str = "/local_nvme"
    """Directory for the nvme tier's swap files (a fast local disk)."""
    buffer_count: int = 4
    """Sub-group buffers of optimizer state in memory at once (nvme): at least 2 lets the
    next sub-group's read overlap the current one's step."""
    pin_memory: bool = True
    """Page-locked CPU buffers (faster host-device copies; CUDA only, ignored on the CPU).
    True when not set, as in DeepSpeed 0.19.8."""
    pipeline_read: bool = False
    """Accepted for compatibility: reads are always overlapped with the step."""
    pipeline_write: bool = False
    """Accepted for compatibility: writes are always overlapped with the step."""
    fast_init: bool = False
    """Accepted for compatibility: swap files are created empty and filled on first write."""
    ratio: float = 1.0
    """Fraction of the optimizer step done on the CPU (only 1.0 is supported)."""

    def __post_init__(self) -> None:
        _check_offload_common("zero_optimization.offload_optimizer", self)
        for name in ("pipeline_read", "pipeline_write", "fast_init"):
            as_bool(f"zero_optimization.offload_optimizer.{name}", getattr(self, name))
        as_number("zero_optimization.offload_optimizer.ratio", self.ratio, minimum=0)
        if self.ratio != 1.0:
            raise ConfigError(
                f"zero_optimization.offload_optimizer.ratio={self.ratio} (a partial CPU "
                "step) is not supported; remove it or set it to 1.0"
            )

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True, kw_only=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param``: stage 3 parameter shards in CPU memory or on
    NVMe."""

    device: str = "none"
    """none, cpu or nvme."""
    nvme_path: str = "/local_nvme"
    """Directory for parameter swap files (nvme)."""
    buffer_count: int = 5
    """Parameter buffers in memory at once (nvme)."""
    buffer_size: int = 100_000_000
    """Elements per parameter buffer (nvme)."""
    max_in_cpu: int = 1_000_000_000
    """Parameter elements kept in CPU memory when device is nvme."""
    pin_memory: bool = True
    """Page-locked CPU buffers (CUDA only, ignored on the CPU). True when not set, as in
    DeepSpeed 0.19.8."""

    def __post_init__(self) -> None:
        _check_offload_common("zero_optimization.offload_param", self)
        as_int("zero_optimization.offload_param.buffer_size", self.buffer_size, minimum=1)
        as_int("zero_optimization.offload_param.max_in_cpu", self.max_in_cpu, minimum=0)

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """``aio``: how swap files are read and written (the nvme offload tier)."""

    block_size: int = 1_048_576
    """Bytes per read/write request."""
    queue_depth: int = 8
    """Swap files read or written at once per intra_op_parallelism (one I/O thread each)."""
    intra_op_parallelism: int = 1
    """Multiplies queue_depth (DeepSpeed's older name: thread_count)."""
    single_submit: bool = False
    """Accepted for compatibility (requests are submitted by the I/O threads)."""
    overlap_events: bool = True
    """Accepted for compatibility (submission and completion always overlap)."""
    use_gds: bool = False
    """NVIDIA GPUDirect Storage (not supported)."""

    def __post_init__(self) -> None:
        as_int("aio.block_size", self.block_size, minimum=4096)
        as_int("aio.queue_depth", self.queue_depth, minimum=1)
        as_int("aio.intra_op_parallelism", self.intra_op_parallelism, minimum=1)
        for name in ("single_submit", "overlap_events", "use_gds"):
            as_bool(f"aio.{name}", getattr(self, name))
        if self.use_gds:
            raise ConfigError("aio.use_gds=true (GPUDirect Storage) is not supported; remove it")


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """``zero_optimization``: which model states are partitioned across ranks, and how."""

    stage: int = 0
    """0: replicated; 1: optimizer states; 2: + gradients; 3: + parameters."""
    reduce_bucket_size: int = 500_000_000
    """Elements per gradient reduction bucket."""
    allgather_bucket_size: int = 500_000_000
    """Elements per parameter all-gather bucket (stages 1-2)."""
    overlap_comm: bool | None = None
    """Overlap gradient reduction with backward (None: the stage's default)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced."""
    reduce_scatter: bool = True
    """Reduce gradients with reduce-scatter rather than all-reduce (stage 2)."""
    allgather_partitions: bool = True
    """All-gather updated partitions (rather than broadcasting them)."""
    round_robin_gradients: bool = False
    """Stage 1/2 gradient copy order across ranks."""
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    """Optimizer-state offload (device cpu/nvme and its options)."""
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    """Stage-3 parameter offload (device cpu/nvme and its options)."""
    sub_group_size: int = 1_000_000_000
    """Elements of optimizer state stepped (and, offloaded to nvme, held in memory) at once."""
    stage3_prefetch_bucket_size: int = 50_000_000
    """Elements prefetched ahead of use (stage 3)."""
    stage3_param_persistence_threshold: int = 100_000
    """Parameters smaller than this stay whole (stage 3)."""
    stage3_max_live_parameters: int = 1_000_000_000
    """Upper bound of gathered parameter elements alive at once (stage 3)."""
    stage3_max_reuse_distance: int = 1_000_000_000
    """Keep a gathered parameter if reused within this many elements (stage 3)."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Gather the full 16-bit model on save_16bit_model (stage 3)."""
    stage3_module_granularity_threshold: int = 0
    """Treat modules with fewer parameters than this as one leaf (stage 3)."""
    elastic_checkpoint: bool = False
    """Accepted for compatibility (shardwise checkpoints are always elastic)."""
    ignore_unused_parameters: bool = True
    """Tolerate parameters that receive no gradient."""
    load_from_fp32_weights: bool = True
    """Initialise master weights from the checkpoint's fp32 copy."""
    legacy_stage1: bool = False
    """Accepted for compatibility; ignored."""
    memory_efficient_linear: bool = True
    """Accepted for compatibility (stage 3)."""
    use_multi_rank_bucket_allreduce: bool = True
    """Accepted for compatibility."""
    zero_hpz_partition_size: int = 1
    """Secondary partition size (ZeRO++ hpZ)."""
    zero_quantized_weights: bool = False
    """Quantize weights in all-gathers (ZeRO++ qwZ)."""
    zero_quantized_nontrainable_weights: bool = False
    """Quantize frozen weights (ZeRO++)."""
    zero_quantized_gradients: bool = False
    """Quantize gradients in reduce-scatter (ZeRO++ qgZ)."""
    mics_shard_size: int = -1
    """MiCS shard group size (-1: off)."""
    mics_hierarchical_params_gather: bool = False
    """MiCS hierarchical all-gather."""
    round_robin: bool = False
    """Accepted for compatibility."""
    cpu_offload: bool = False
    """Legacy flag, equal to offload_optimizer.device = cpu."""
    log_trace_cache_warnings: bool = False
    """Stage-3 trace cache warnings."""

    def __post_init__(self) -> None:
        as_int("zero_optimization.stage", self.stage, minimum=0, maximum=3)
        for name in ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size"):
            as_int(f"zero_optimization.{name}", getattr(self, name), minimum=1)
        as_int("zero_optimization.zero_hpz_partition_size", self.zero_hpz_partition_size, minimum=0)
        # 0 is meaningful: no prefetch, no parameters kept beyond the one in use, no reuse
        for name in (
            "stage3_prefetch_bucket_size",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
            "stage3_param_persistence_threshold",
            "stage3_module_granularity_threshold",
        ):
            as_int(f"zero_optimization.{name}", getattr(self, name), minimum=0)
        as_int("zero_optimization.mics_shard_size", self.mics_shard_size, minimum=-1)
        if self.overlap_comm is not None:
            as_bool("zero_optimization.overlap_comm", self.overlap_comm)
        if self.cpu_offload and not self.offload_optimizer.enabled:  # the legacy flag
            object.__setattr__(self, "offload_optimizer", OffloadOptimizerConfig(device="cpu"))
        if self.offload_param.enabled and self.stage != 3:
            raise ConfigError(
                f"zero_optimization.offload_param needs stage 3 (parameters are only "
                f"partitioned there), got stage {self.stage}; set stage to 3 or remove it"
            )
        if self.offload_param.device == "nvme" and self.offload_optimizer.device != "nvme":
            raise ConfigError(
                'zero_optimization.offload_param.device="nvme" needs offload_optimizer.device '
                '"nvme" too in this version (the fp32 parameter shards are the optimizer\'s '
                "masters and are swapped with its state); set both to nvme, or offload_param to cpu"
            )
        if self.offload_optimizer.enabled and self.stage == 0:
            raise ConfigError(
                "zero_optimization.offload_optimizer needs stage 1, 2 or 3 (the optimizer "
                "state must be partitioned to offload it); set zero_optimization.stage"
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """``checkpoint``: checkpoint behaviour."""

    tag_validation: str = "Warn"
    """What to do when ranks pass different tags: Ignore, Warn or Fail."""
    load_universal: bool = False
    """Accepted for compatibility: every shardwise checkpoint loads under any layout."""
    use_node_local_storage: bool = False
    """Each node writes to its own storage."""
    parallel_write: Mapping[str, Any] | None = None
    """Pipeline-stage parallel write options."""

    def __post_init__(self) -> None:
        as_choice("checkpoint.tag_validation", self.tag_validation, ("Ignore", "Warn", "Fail"))


@dataclass(frozen=True, kw_only=True)
class DataTypesConfig:
    """``data_types``: dtypes of intermediate buffers."""

    grad_accum_dtype: str | None = None
    """dtype gradients accumulate in (None: the parameter dtype)."""
    param_dtype: str | None = None
    """dtype of the parameters; must be the one fp16/bf16 selects (None: that one)."""
    buffer_dtype: str | None = None
    """dtype to cast module buffers to (None: keep their dtype; only None is supported)."""

    def __post_init__(self) -> None:
        for name in ("grad_accum_dtype", "param_dtype", "buffer_dtype"):
            if getattr(self, name) is not None:
                as_choice(f"data_types.{name}", getattr(self, name), ("fp32", "fp16", "bf16"))
        if self.buffer_dtype is not None:
            raise ConfigError(
                f"data_types.buffer_dtype={self.buffer_dtype!r} (casting module buffers) is not "
                "available in this version of shardwise; remove it (buffers keep their dtype)"
            )


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: what ``deepspeed.checkpointing.checkpoint`` stores for
    backward. As in DeepSpeed, it takes effect when the script calls
    ``deepspeed.checkpointing.configure(mpu, deepspeed_config=...)``; the engine does not
    call it, and ``torch.utils.checkpoint`` (Hugging Face's gradient checkpointing) does
    not read it."""

    partition_activations: bool = False
    """Store each rank's 1/tp slice of every checkpointed floating-point input and
    all-gather it across the tensor-parallel group for the recompute."""
    cpu_checkpointing: bool = False
    """Keep the stored inputs (or their slices) in host memory until the recompute."""
    contiguous_memory_optimization: bool = False
    """Store the slices in one preallocated buffer per input position, with
    number_checkpoints slots (needs partition_activations and number_checkpoints)."""
    number_checkpoints: int | None = None
    """checkpoint() calls per forward (the slots of the contiguous buffers)."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the device at the start and end of each checkpoint's forward and backward."""
    profile: bool = False
    """Log the time of each checkpoint's forward and of its backward (recompute included)."""

    def __post_init__(self) -> None:
        for name in (
            "partition_activations",
            "cpu_checkpointing",
            "contiguous_memory_optimization",
            "synchronize_checkpoint_boundary",
            "profile",
        ):
            as_bool(f"activation_checkpointing.{name}", getattr(self, name))
        if self.number_checkpoints is not None:
            as_int("activation_checkpointing.number_checkpoints", self.number_checkpoints, minimum=1)


@dataclass(frozen=True, kw_only=True)
class CommConfig:
    """``comm`` (shardwise extension): collective deadlines."""

    timeout_s: float = 1800.0
    """Seconds a collective may wait before it is reported as a hang, naming the ranks (on
    NCCL by a watch thread, which then ends the process; see [Note: stream-ordered waits])."""
    check_hangs: bool = True
    """Exchange what each rank waited in when a collective fails."""

    def __post_init__(self) -> None:
        as_number("comm.timeout_s", self.timeout_s, minimum=0, strict=True)
        as_bool("comm.check_hangs", self.check_hangs)
