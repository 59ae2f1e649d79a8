"""The ``autotuning`` section: DeepSpeed 0.19.8's autotuner keys and defaults, plus two
shardwise extensions (``memory_per_rank``, ``experiment_timeout_s``). Read by
``shardwise run --autotuning`` (``shardwise/autotuning/``) and, inside each experiment, by
the engine's profiling feature (``runtime/_autotuning_profile.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardwise.config._errors import ConfigError, as_bool, as_choice, as_int, as_number, check_keys

METRICS = ("throughput", "latency", "flops")
TUNER_TYPES = ("gridsearch", "random", "model_based")


@dataclass(frozen=True, kw_only=True)
class ModelInfoConfig:
    """``autotuning.model_info``: what the tuner knows about the model without running it."""

    profile: bool = False
    """Run one short profiling experiment that writes the parameter count to
    ``model_info_path`` and exits (the tuner does it by itself when ``num_params`` is not
    given)."""
    num_params: int | None = None
    """Parameters of the model; the memory estimator prunes with it before anything runs
    (None: measured by a profiling run first)."""
    hidden_size: int | None = None
    """Accepted for compatibility (DeepSpeed sizes stage-3 buckets from it)."""
    num_layers: int | None = None
    """Accepted for compatibility."""

    def __post_init__(self) -> None:
        as_bool("autotuning.model_info.profile", self.profile)
        for name in ("num_params", "hidden_size", "num_layers"):
            if getattr(self, name) is not None:
                as_int(f"autotuning.model_info.{name}", getattr(self, name), minimum=1)


@dataclass(frozen=True, kw_only=True)
class AutotuningConfig:
    """``autotuning``: the search ``shardwise run --autotuning tune|run`` performs, and the
    profiled run each of its experiments is."""

    enabled: bool = False
    """Mark the config as an autotuning config: the engine measures the steps
    ``start_profile_step..end_profile_step``, writes their metrics to ``metric_path`` and
    exits, as DeepSpeed's engine does (the tuner sets it in every experiment's config)."""
    fast: bool = True
    """Tune ZeRO stage and micro-batch size only; false adds optimizer (and, at stage 3,
    parameter) offload to the space."""
    results_dir: str = "autotuning_results"
    """Where ``summary.txt``, ``ds_config_optimal.json``, ``cmd_optimal.txt`` and one folder
    per experiment (its config, command, logs and ``metrics.json``) are written."""
    exps_dir: str = "autotuning_exps"
    """Where each experiment's description (``<name>.json``) is written before it runs."""
    overwrite: bool = True
    """Run every experiment again; false reuses an experiment whose ``metrics.json`` is
    already in ``results_dir``."""
    start_profile_step: int = 3
    """The first optimizer step of the measured window (the steps before it warm up)."""
    end_profile_step: int = 5
    """The last measured step; the experiment exits after it."""
    metric: str = "throughput"
    """What the tuner optimizes: ``throughput`` (samples/s, highest wins), ``latency``
    (ms per optimizer step, lowest wins) or ``flops`` (FLOP/s per rank, counted over one
    iteration; highest wins)."""
    metric_path: str | None = None
    """Where the experiment writes its metrics (set by the tuner for each experiment; None
    in an enabled run: ``autotuning_metric.json`` in the working directory, as DeepSpeed)."""
    model_info_path: str | None = None
    """Where a profiling run writes the model information (set by the tuner; None:
    ``autotuning_model_info.json`` in the working directory, as DeepSpeed)."""
    tuner_type: str = "gridsearch"
    """Order of the experiments: ``gridsearch`` (stage, then micro-batch, ascending),
    ``random`` (seeded shuffle) or ``model_based`` (a least-squares cost model fitted to the
    measured experiments picks the next one; see the user guide)."""
    tuner_early_stopping: int = 5
    """Stop after this many experiments in a row that did not beat the best one."""
    tuner_num_trials: int = 50
    """Run at most this many experiments (pruned configurations do not count)."""
    arg_mappings: Mapping[str, str] | None = None
    """Config key -> script flag (``{"train_micro_batch_size_per_gpu": "--per_device_train_
    batch_size"}``): each experiment passes its value to the script under that flag too."""
    max_train_batch_size: int | None = None
    """Largest global batch an experiment may use (None: no bound)."""
    min_train_batch_size: int = 1
    """Smallest global batch an experiment may use."""
    max_train_micro_batch_size_per_gpu: int = 1024
    """Largest micro-batch tried."""
    min_train_micro_batch_size_per_gpu: int = 1
    """Smallest micro-batch tried."""
    num_tuning_micro_batch_sizes: int = 3
    """How many micro-batch sizes (powers of two between the bounds, the largest kept) are
    tried per ZeRO stage."""
    mp_size: int = 1
    """Model-parallel degree of the script; the data-parallel size is world size / mp_size."""
    model_info: ModelInfoConfig | None = None
    """What the tuner knows about the model (None: nothing; a profiling run counts the
    parameters)."""
    memory_per_rank: int | None = None
    """shardwise extension: bytes one rank may hold, for pruning (None: the device's memory
    on GPU, the machine's RAM divided by the local ranks on CPU)."""
    experiment_timeout_s: float = 600.0
    """shardwise extension: an experiment still running after this many seconds is killed
    (its whole process tree) and recorded as hung."""

    def __post_init__(self) -> None:
        for name in ("enabled", "fast", "overwrite"):
            as_bool(f"autotuning.{name}", getattr(self, name))
        for name in ("results_dir", "exps_dir"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"autotuning.{name} must be a non-empty path, got {getattr(self, name)!r}")
        as_int("autotuning.start_profile_step", self.start_profile_step, minimum=1)
        as_int("autotuning.end_profile_step", self.end_profile_step, minimum=1)
        if self.end_profile_step < self.start_profile_step:
            raise ConfigError(
                f"autotuning.end_profile_step ({self.end_profile_step}) is before start_profile_step "
                f"({self.start_profile_step}); the measured window needs end >= start"
            )
        as_choice("autotuning.metric", self.metric, METRICS)
        as_choice("autotuning.tuner_type", self.tuner_type, TUNER_TYPES)
        for name in ("tuner_early_stopping", "tuner_num_trials", "num_tuning_micro_batch_sizes", "mp_size"):
            as_int(f"autotuning.{name}", getattr(self, name), minimum=1)
        for name in (
            "min_train_batch_size",
            "min_train_micro_batch_size_per_gpu",
            "max_train_micro_batch_size_per_gpu",
        ):
            as_int(f"autotuning.{name}", getattr(self, name), minimum=1)
        _check_bounds(
            "train_micro_batch_size_per_gpu",
            self.min_train_micro_batch_size_per_gpu,
            self.max_train_micro_batch_size_per_gpu,
        )
        if self.max_train_batch_size is not None:
            as_int("autotuning.max_train_batch_size", self.max_train_batch_size, minimum=1)
            _check_bounds("train_batch_size", self.min_train_batch_size, self.max_train_batch_size)
        if self.memory_per_rank is not None:
            as_int("autotuning.memory_per_rank", self.memory_per_rank, minimum=1)
        as_number("autotuning.experiment_timeout_s", self.experiment_timeout_s, minimum=0, strict=True)
        if self.arg_mappings is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.arg_mappings.items()
        ):
            raise ConfigError(
                f"autotuning.arg_mappings must map config keys to script flags, got {self.arg_mappings!r}"
            )


def _check_bounds(name: str, low: int, high: int) -> None:
    if low > high:
        raise ConfigError(
            f"autotuning.min_{name} ({low}) is greater than autotuning.max_{name} ({high}); "
            "no batch size satisfies both bounds: lower the minimum or raise the maximum"
        )


def autotuning_config(section: Any) -> AutotuningConfig:
    """The validated ``autotuning`` section (None: the defaults, off); unknown keys are
    refused with the closest valid one."""
    if section is None:
        return AutotuningConfig()
    fields = {f.name for f in dataclasses.fields(AutotuningConfig)}
    values = dict(check_keys("autotuning", section, fields))
    if values.get("arg_mappings") is not None and not isinstance(values["arg_mappings"], dict):
        raise ConfigError(f"autotuning.arg_mappings must be a JSON object, got {values['arg_mappings']!r}")
    for name, choices in (("metric", METRICS), ("tuner_type", TUNER_TYPES)):
        if name in values:
            values[name] = as_choice(f"autotuning.{name}", values[name], choices)
    info = values.get("model_info")
    if info is not None:
        info_fields = {f.name for f in dataclasses.fields(ModelInfoConfig)}
        values["model_info"] = ModelInfoConfig(**_ints(check_keys("autotuning.model_info", info, info_fields)))
    return AutotuningConfig(**_ints(values))


def _ints(values: dict) -> dict:
    """Integer-valued floats (``1e6``) as ints, as the other sections read them."""
    return {
        k: int(v) if isinstance(v, float) and v.is_integer() and k != "experiment_timeout_s" else v
        for k, v in values.items()
    }
