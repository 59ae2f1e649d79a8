"""Monitoring and profiling sections: the monitors (``tensorboard``, ``wandb``,
``csv_monitor``, ``comet``), ``flops_profiler`` and ``comms_logger``, with DeepSpeed's keys
and defaults. Pure Python: whether a monitor's package is installed and its directory
writable is checked where the monitor is built (``shardwise.monitor``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.config._errors import ConfigError, as_bool, as_int, as_number


@dataclass(frozen=True, kw_only=True)
class FileMonitorConfig:
    """``tensorboard`` and ``csv_monitor``: files under ``output_path/job_name`` (validated by
    the adapter, which knows which of the two sections it reads)."""

    enabled: bool = False
    """Write events (global rank 0 only)."""
    output_path: str = ""
    """Directory the job's folder is made in ("" means the current directory)."""
    job_name: str = "DeepSpeedJobName"
    """Folder name of this run under ``output_path``."""


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """``wandb``: a Weights & Biases run (``WANDB_MODE=offline`` works without network)."""

    enabled: bool = False
    """Log events to a W&B run (global rank 0 only)."""
    group: str | None = None
    """W&B run group."""
    team: str | None = None
    """W&B entity (team or user)."""
    project: str = "deepspeed"
    """W&B project."""

    def __post_init__(self) -> None:
        as_bool("wandb.enabled", self.enabled)


@dataclass(frozen=True, kw_only=True)
class CometConfig:
    """``comet``: a Comet ML experiment."""

    enabled: bool = False
    """Log events to a Comet experiment (global rank 0 only)."""
    samples_log_interval: int = 100
    """Log a tag again only after this many samples."""
    project: str | None = None
    """Comet project."""
    workspace: str | None = None
    """Comet workspace."""
    api_key: str | None = None
    """Comet API key (None: Comet's own configuration)."""
    experiment_name: str | None = None
    """Name given to the experiment."""
    experiment_key: str | None = None
    """Key of an experiment to continue."""
    online: bool | None = None
    """False: an offline experiment."""
    mode: str | None = None
    """"get", "create" or "get_or_create"."""

    def __post_init__(self) -> None:
        as_bool("comet.enabled", self.enabled)
        as_int("comet.samples_log_interval", self.samples_log_interval, minimum=1)
        if self.mode not in (None, "get", "create", "get_or_create"):
            raise ConfigError(f"comet.mode must be one of get, create, get_or_create, got {self.mode!r}")


@dataclass(frozen=True, kw_only=True)
class FlopsProfilerConfig:
    """``flops_profiler``: profile one training step and print the model's FLOPs."""

    enabled: bool = False
    """Profile the step ``profile_step``."""
    recompute_fwd_factor: float = 0.0
    """Share of the forward recomputed by activation checkpointing (0 to 1)."""
    profile_step: int = 1
    """The engine's ``global_steps`` value of the profiled step (0 is the first step; a later
    one keeps one-time costs out of the latencies)."""
    module_depth: int = -1
    """Depth of the per-module tree printed (-1: all)."""
    top_modules: int = 1
    """Modules listed per depth in the aggregated section."""
    detailed: bool = True
    """Print the per-module tree."""
    output_file: str | None = None
    """Write the profile here instead of standard output."""

    def __post_init__(self) -> None:
        as_bool("flops_profiler.enabled", self.enabled)
        as_bool("flops_profiler.detailed", self.detailed)
        as_number("flops_profiler.recompute_fwd_factor", self.recompute_fwd_factor, minimum=0)
        as_int("flops_profiler.profile_step", self.profile_step, minimum=0)
        as_int("flops_profiler.top_modules", self.top_modules, minimum=1)
        if not isinstance(self.module_depth, int) or isinstance(self.module_depth, bool) or self.module_depth < -1:
            raise ConfigError(
                f"flops_profiler.module_depth must be an integer >= -1 (-1: every depth), got {self.module_depth!r}"
            )


@dataclass(frozen=True, kw_only=True)
class CommsLoggerConfig:
    """``comms_logger``: count and time collectives (``shardwise.comm.log_summary()``); also
    the settings ``shardwise.comm.configure`` changes (see [Note: the comms logger])."""

    enabled: bool = False
    """Time the selected collectives (off: one boolean check per collective)."""
    verbose: bool = False
    """Log each timed collective as it completes (rank 0, INFO): name, latency, size, bandwidths."""
    prof_all: bool = True
    """Time every collective (False: only ``prof_ops`` and calls with ``prof=True``)."""
    debug: bool = False
    """Append the calling function's name to the log name, to tell call sites apart."""
    prof_ops: tuple[str, ...] = ()
    """Log names timed when ``prof_all`` is false (e.g. "all_reduce"); a list is accepted."""

    def __post_init__(self) -> None:
        for name in ("enabled", "prof_all", "verbose", "debug"):
            as_bool(f"comms_logger.{name}", getattr(self, name))
        ops = self.prof_ops
        if isinstance(ops, str) or not isinstance(ops, (list, tuple)) or not all(isinstance(o, str) for o in ops):
            raise ConfigError(f'comms_logger.prof_ops must be a list of op names such as ["all_reduce"], got {ops!r}')
        object.__setattr__(self, "prof_ops", tuple(ops))


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """Everything that watches a run; nested in ``TrainConfig.monitor``."""

    tensorboard: FileMonitorConfig = field(default_factory=FileMonitorConfig)
    """TensorBoard event files."""
    csv_monitor: FileMonitorConfig = field(default_factory=FileMonitorConfig)
    """One CSV file per tag."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases."""
    comet: CometConfig = field(default_factory=CometConfig)
    """Comet ML."""
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    """The FLOPs profiler."""
    comms_logger: CommsLoggerConfig = field(default_factory=CommsLoggerConfig)
    """The communication logger."""
    memory_breakdown: bool = False
    """Log allocated / peak / host memory and model-state bytes every optimizer step."""

    @property
    def enabled(self) -> bool:
        """Whether any monitor writes events."""
        return any(m.enabled for m in (self.tensorboard, self.csv_monitor, self.wandb, self.comet))
