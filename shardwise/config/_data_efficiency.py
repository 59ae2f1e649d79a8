"""DeepSpeed's curriculum-learning and layer-drop sections, DeepSpeed 0.19.8's keys and
defaults: the legacy top-level ``curriculum_learning`` (a sequence-length curriculum the
engine passes to the model's forward) and ``progressive_layer_drop``. Read by
``runtime/data_pipeline/``.

A curriculum schedule (``min_difficulty``, ``max_difficulty``, ``schedule_type``,
``schedule_config``) is the same in every place DeepSpeed takes one; it is parsed once, by
:func:`curriculum_schedule_config`, here and for ``CurriculumScheduler(config)``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardwise.config._errors import ConfigError, as_bool, as_choice, as_int, as_number, check_keys

logger = logging.getLogger("shardwise")

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")
"""DeepSpeed's curriculum schedule types."""

# schedule_type -> the schedule_config keys it needs
_SCHEDULE_KEYS = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
    "custom": (),
}
_ALL_SCHEDULE_KEYS = {key for keys in _SCHEDULE_KEYS.values() for key in keys}


@dataclass(frozen=True, kw_only=True)
class CurriculumScheduleConfig:
    """How a curriculum's difficulty grows with the optimizer step (DeepSpeed's
    ``CurriculumScheduler`` config, with ``schedule_config`` read into fields)."""

    min_difficulty: int | float
    """The difficulty at step 0 (for ``seqlen``: the first sequence length)."""
    max_difficulty: int | float
    """The difficulty the schedule ends at; once reached it no longer changes."""
    schedule_type: str
    """``fixed_linear``, ``fixed_root``, ``fixed_discrete`` or ``custom`` (a function given
    with ``set_custom_curriculum_learning_schedule``)."""
    total_curriculum_step: int | None = None
    """fixed_linear / fixed_root: the step at which ``max_difficulty`` is reached."""
    difficulty_step: int | None = None
    """fixed_linear / fixed_root: every difficulty is a multiple of this (8 or 16 keeps
    sequence lengths Tensor-Core friendly)."""
    root_degree: int | float | None = None
    """fixed_root: 2 is a square-root curve, 3 a cube root (1 is linear)."""
    difficulty: tuple = ()
    """fixed_discrete: the difficulties, increasing."""
    max_step: tuple = ()
    """fixed_discrete: the last step of each difficulty but the last (one fewer than
    ``difficulty``), increasing."""


def _need(path: str, section: Mapping, key: str, why: str) -> Any:
    if key not in section:
        raise ConfigError(f"{path} needs '{key}' ({why})")
    return section[key]


def _increasing(path: str, values: Any, *, what: str) -> tuple:
    if not isinstance(values, (list, tuple)) or not values:
        raise ConfigError(f"{path} must be a non-empty list of {what}, got {values!r}")
    numbers = tuple(as_number(f"{path}[{i}]", v) for i, v in enumerate(values))
    for i in range(1, len(numbers)):
        if numbers[i] <= numbers[i - 1]:
            raise ConfigError(f"{path} must be increasing: {path}[{i}]={values[i]!r} follows {values[i - 1]!r}")
    return tuple(values)


def _schedule_fields(path: str, schedule_type: str, section: Any) -> dict:
    """The ``schedule_config`` keys ``schedule_type`` needs, validated."""
    needed = _SCHEDULE_KEYS[schedule_type]
    why = f"schedule_type {schedule_type!r} needs {', '.join(needed)}"
    if section is None and needed:
        raise ConfigError(f"{path} is missing ({why})")
    section = check_keys(path, section or {}, _ALL_SCHEDULE_KEYS)
    unused = sorted(set(section) - set(needed))
    if unused:
        logger.warning("%s: %s not used by schedule_type %r; ignored", path, ", ".join(unused), schedule_type)
    values = {key: _need(path, section, key, why) for key in needed}
    if schedule_type == "fixed_discrete":
        values["difficulty"] = _increasing(f"{path}.difficulty", values["difficulty"], what="difficulties")
        values["max_step"] = _increasing(f"{path}.max_step", values["max_step"], what="steps")
        if len(values["difficulty"]) != len(values["max_step"]) + 1:
            raise ConfigError(
                f"{path}.difficulty has {len(values['difficulty'])} entries and {path}.max_step "
                f"{len(values['max_step'])}: max_step needs one fewer (the last difficulty holds "
                "for every later step)"
            )
    if "total_curriculum_step" in values:
        as_int(f"{path}.total_curriculum_step", values["total_curriculum_step"], minimum=1)
        as_int(f"{path}.difficulty_step", values["difficulty_step"], minimum=1)
    if "root_degree" in values:
        as_number(f"{path}.root_degree", values["root_degree"], minimum=0, strict=True)
    return values


def curriculum_schedule_config(path: str, section: Any) -> CurriculumScheduleConfig:
    """Validate a DeepSpeed curriculum schedule (``min_difficulty``, ``max_difficulty``,
    ``schedule_type``, ``schedule_config``; other keys of ``section`` are the caller's).

    Raises:
        ConfigError: a missing key (named, with the schedule that needs it), an unknown
            schedule type, ``min_difficulty`` above ``max_difficulty``, or fixed_discrete
            difficulties or steps that are not increasing.
    """
    if not isinstance(section, Mapping):
        raise ConfigError(f"'{path}' must be a JSON object, got {section!r}")
    why = "every curriculum schedule needs min_difficulty, max_difficulty and schedule_type"
    low = as_number(f"{path}.min_difficulty", _need(path, section, "min_difficulty", why))
    high = as_number(f"{path}.max_difficulty", _need(path, section, "max_difficulty", why))
    if low > high:
        raise ConfigError(
            f"{path}.min_difficulty={section['min_difficulty']!r} is above "
            f"{path}.max_difficulty={section['max_difficulty']!r}; the difficulty only grows"
        )
    schedule_type = as_choice(
        f"{path}.schedule_type", _need(path, section, "schedule_type", why), SCHEDULE_TYPES, case_insensitive=False
    )
    fields = _schedule_fields(f"{path}.schedule_config", schedule_type, section.get("schedule_config"))
    return CurriculumScheduleConfig(
        min_difficulty=section["min_difficulty"],
        max_difficulty=section["max_difficulty"],
        schedule_type=schedule_type,
        **fields,
    )


@dataclass(frozen=True, kw_only=True)
class LegacyCurriculumConfig:
    """The top-level ``curriculum_learning`` section (DeepSpeed's legacy curriculum): the
    engine passes ``curriculum_seqlen`` to the model's training forward. The schedule keys
    are checked when the section is enabled."""

    enabled: bool = False
    """Schedule the sequence length and pass it to the model's forward."""
    curriculum_type: str = "seqlen"
    """What the difficulty is; ``seqlen`` (the sequence length) is the only type."""
    min_difficulty: int | float | None = None
    """The first sequence length (required when enabled)."""
    max_difficulty: int | float | None = None
    """The full sequence length the schedule ends at (required when enabled)."""
    schedule_type: str | None = None
    """``fixed_linear``, ``fixed_root``, ``fixed_discrete`` or ``custom`` (required when
    enabled; see ``CurriculumScheduleConfig``)."""
    schedule_config: Mapping[str, Any] | None = None
    """The schedule's parameters (``total_curriculum_step``, ``difficulty_step``,
    ``root_degree``; ``difficulty`` and ``max_step`` for fixed_discrete)."""

    def __post_init__(self) -> None:
        as_bool("curriculum_learning.enabled", self.enabled)
        as_choice("curriculum_learning.curriculum_type", self.curriculum_type, ("seqlen",), case_insensitive=False)
        if self.enabled:
            curriculum_schedule_config("curriculum_learning", self.scheduler_config())

    def scheduler_config(self) -> dict:
        """The section without ``enabled``, as DeepSpeed's ``CurriculumScheduler`` takes it
        (DeepSpeed's ``curriculum_params_legacy()``)."""
        fields = ("curriculum_type", "min_difficulty", "max_difficulty", "schedule_type", "schedule_config")
        values = {name: getattr(self, name) for name in fields}
        if values["schedule_config"] is not None:
            values["schedule_config"] = copy.deepcopy(dict(values["schedule_config"]))
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True, kw_only=True)
class ProgressiveLayerDropConfig:
    """The ``progressive_layer_drop`` section: the engine passes ``progressive_layer_drop=True,
    pld_theta=<keep probability>`` to the model's training forward."""

    enabled: bool = False
    """Schedule the layer keep probability and pass it to the model's forward."""
    theta: float = 1.0
    """The keep probability the schedule decays to (1.0, DeepSpeed's config default: no
    layer is ever dropped; the PLD paper uses 0.5)."""
    gamma: float = 0.001
    """How fast the keep probability decays: ``(1 - theta) * exp(-gamma * step) + theta``."""

    def __post_init__(self) -> None:
        as_bool("progressive_layer_drop.enabled", self.enabled)
        theta = as_number("progressive_layer_drop.theta", self.theta, minimum=0)
        if theta > 1:
            raise ConfigError(f"progressive_layer_drop.theta is a keep probability, from 0 to 1; got {self.theta!r}")
        as_number("progressive_layer_drop.gamma", self.gamma, minimum=0)


def legacy_curriculum_config(section: Any) -> LegacyCurriculumConfig:
    """The validated top-level ``curriculum_learning`` section (None: off)."""
    if section is None:
        return LegacyCurriculumConfig()
    fields = {f.name for f in dataclasses.fields(LegacyCurriculumConfig)}
    return LegacyCurriculumConfig(**check_keys("curriculum_learning", section, fields))


def progressive_layer_drop_config(section: Any) -> ProgressiveLayerDropConfig:
    """The validated ``progressive_layer_drop`` section (None: off)."""
    if section is None:
        return ProgressiveLayerDropConfig()
    section = check_keys("progressive_layer_drop", section, {"enabled", "theta", "gamma"})
    return ProgressiveLayerDropConfig(**section)


# -- the data_efficiency section (DeepSpeed's data-efficiency library) --------------------


@dataclass(frozen=True, kw_only=True)
class CurriculumMetricConfig:
    """One metric of ``data_efficiency.data_sampling.curriculum_learning.curriculum_metrics``:
    where the data analyzer's index files are, and the metric's schedule."""

    index_to_sample_path: str | None = None
    """The index file of samples by metric value (needed unless ``clustering_type`` is
    ``single_cluster``)."""
    index_to_metric_path: str | None = None
    """The index file of metric values (needed for ``difficulty_type`` ``value``)."""
    difficulty_type: str
    """``value`` (difficulties are metric values) or ``percentile`` (1-100)."""
    clustering_type: str
    """``single_cluster`` (one cluster, no index files) or ``schedule_based``."""
    schedule: CurriculumScheduleConfig
    """``min_difficulty``, ``max_difficulty``, ``schedule_type``, ``schedule_config``."""


@dataclass(frozen=True, kw_only=True)
class DataSamplingCurriculumConfig:
    """``data_efficiency.data_sampling.curriculum_learning``: curriculum data sampling."""

    enabled: bool = False
    """Sample by scheduled difficulty: ``engine.deepspeed_io`` (and ``initialize``'s
    ``training_data``) draw micro-batches from a ``DeepSpeedDataSampler``."""
    data_cluster_path: str | None = None
    """Where the sampler keeps its clusters of samples."""
    curriculum_metrics: Mapping[str, CurriculumMetricConfig] = dataclasses.field(default_factory=dict)
    """The metrics by name (at least one when enabled)."""


LR_SCALING_METHODS = ("linear", "sqrt", "none")
SEQUENCE_PICKING_ORDERS = ("dataloader", "random", "seqlen")


@dataclass(frozen=True, kw_only=True)
class DynamicBatchingConfig:
    """``data_efficiency.data_sampling.dynamic_batching``: batches of a token budget."""

    enabled: bool = False
    """Pack variable-length samples into batches of ``max_tokens``: allows
    ``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset, engine)``
    (DeepSpeed's engine builds no such loader by itself either)."""
    metrics_path: str | None = None
    """The data analyzer's output with the sequence lengths."""
    lr_scaling_method: str = "linear"
    """How the learning rate follows the batch size: ``linear``, ``sqrt`` or ``none``."""
    min_batch_size: int = 1
    """The fewest samples in a batch."""
    max_batch_size: int | None = None
    """The most samples in a batch (None: no limit)."""
    sequence_picking_order: str = "dataloader"
    """The order samples are packed in: ``dataloader``, ``random`` or ``seqlen``."""
    max_tokens: int | None = None
    """Tokens per batch (required when enabled)."""
    verbose: bool = False
    """Log the batches built."""

    def __post_init__(self) -> None:
        path = "data_efficiency.data_sampling.dynamic_batching"
        as_bool(f"{path}.enabled", self.enabled)
        as_bool(f"{path}.verbose", self.verbose)
        as_choice(f"{path}.lr_scaling_method", self.lr_scaling_method, LR_SCALING_METHODS, case_insensitive=False)
        as_choice(f"{path}.sequence_picking_order", self.sequence_picking_order, SEQUENCE_PICKING_ORDERS)
        as_int(f"{path}.min_batch_size", self.min_batch_size, minimum=1)
        if self.max_batch_size is not None:
            as_int(f"{path}.max_batch_size", self.max_batch_size, minimum=self.min_batch_size)
        if self.enabled and self.max_tokens is None:
            raise ConfigError(f"{path}.max_tokens is required when dynamic batching is enabled")
        if self.max_tokens is not None:
            as_int(f"{path}.max_tokens", self.max_tokens, minimum=1)


@dataclass(frozen=True, kw_only=True)
class DataSamplingConfig:
    """``data_efficiency.data_sampling``."""

    enabled: bool = False
    """DeepSpeed's switch of the section (its features have their own)."""
    num_epochs: int = 1000
    """Epochs the curriculum sampler plans for."""
    num_workers: int = 0
    """Data-loader worker processes of the sampler's loader."""
    pin_memory: bool = False
    """Pin the sampler's batches in host memory."""
    curriculum_learning: DataSamplingCurriculumConfig = dataclasses.field(default_factory=DataSamplingCurriculumConfig)
    """Curriculum data sampling."""
    dynamic_batching: DynamicBatchingConfig = dataclasses.field(default_factory=DynamicBatchingConfig)
    """Token-budget batches."""


@dataclass(frozen=True, kw_only=True)
class DataRoutingConfig:
    """``data_efficiency.data_routing``."""

    enabled: bool = False
    """DeepSpeed's switch of the section (random-LTD has its own)."""
    random_ltd: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The ``random_ltd`` section as given (random layerwise token drop), checked by
    ``parse_random_ltd`` when enabled; the engine's training features drive it."""


@dataclass(frozen=True, kw_only=True)
class DataEfficiencyConfig:
    """``data_efficiency``: DeepSpeed's data-efficiency library. Each feature has its own
    ``enabled``, which alone switches it on (as in DeepSpeed, whatever the section
    switches say)."""

    enabled: bool = False
    """DeepSpeed's switch of the section."""
    seed: int = 1234
    """Seed of the curriculum sampler's random numbers."""
    data_sampling: DataSamplingConfig = dataclasses.field(default_factory=DataSamplingConfig)
    """Curriculum data sampling and dynamic batching."""
    data_routing: DataRoutingConfig = dataclasses.field(default_factory=DataRoutingConfig)
    """Random layerwise token drop."""


def _metric(path: str, section: Any) -> CurriculumMetricConfig:
    valid = {"index_to_sample_path", "index_to_metric_path", "difficulty_type", "clustering_type"}
    section = check_keys(
        path, section, valid | {"min_difficulty", "max_difficulty", "schedule_type", "schedule_config"}
    )
    why = "every curriculum metric needs difficulty_type (value|percentile) and clustering_type"
    difficulty_type = as_choice(
        f"{path}.difficulty_type",
        _need(path, section, "difficulty_type", why),
        ("value", "percentile"),
        case_insensitive=False,
    )
    clustering_type = as_choice(
        f"{path}.clustering_type", _need(path, section, "clustering_type", why), ("single_cluster", "schedule_based")
    )
    if clustering_type != "single_cluster":
        _need(path, section, "index_to_sample_path", "clustering_type schedule_based reads the data analyzer's index")
        if difficulty_type == "value":
            _need(path, section, "index_to_metric_path", "difficulty_type value reads the data analyzer's metric index")
    return CurriculumMetricConfig(
        index_to_sample_path=section.get("index_to_sample_path"),
        index_to_metric_path=section.get("index_to_metric_path"),
        difficulty_type=difficulty_type,
        clustering_type=clustering_type,
        schedule=curriculum_schedule_config(path, section),
    )


def _sampling_curriculum(path: str, section: Any) -> DataSamplingCurriculumConfig:
    """The metrics are read when the curriculum is enabled (as DeepSpeed reads them)."""
    section = check_keys(path, section, {"enabled", "data_cluster_path", "curriculum_metrics"})
    enabled = as_bool(f"{path}.enabled", section.get("enabled", False))
    if not enabled:
        return DataSamplingCurriculumConfig(data_cluster_path=section.get("data_cluster_path"))
    why = "curriculum data sampling needs data_cluster_path and one curriculum_metrics entry per metric"
    cluster_path = _need(path, section, "data_cluster_path", why)
    metrics = _need(path, section, "curriculum_metrics", why)
    if not isinstance(metrics, Mapping) or not metrics:
        raise ConfigError(f"{path}.curriculum_metrics must be a non-empty object of metrics by name, got {metrics!r}")
    return DataSamplingCurriculumConfig(
        enabled=True,
        data_cluster_path=cluster_path,
        curriculum_metrics={name: _metric(f"{path}.curriculum_metrics.{name}", m) for name, m in metrics.items()},
    )


def _data_sampling(path: str, section: Any) -> DataSamplingConfig:
    valid = {"enabled", "num_epochs", "num_workers", "pin_memory", "curriculum_learning", "dynamic_batching"}
    section = check_keys(path, section, valid)
    dynamic = check_keys(
        f"{path}.dynamic_batching", section.get("dynamic_batching", {}), _field_names(DynamicBatchingConfig)
    )
    return DataSamplingConfig(
        enabled=as_bool(f"{path}.enabled", section.get("enabled", False)),
        num_epochs=as_int(f"{path}.num_epochs", section.get("num_epochs", 1000), minimum=1),
        num_workers=as_int(f"{path}.num_workers", section.get("num_workers", 0), minimum=0),
        pin_memory=as_bool(f"{path}.pin_memory", section.get("pin_memory", False)),
        curriculum_learning=_sampling_curriculum(f"{path}.curriculum_learning", section.get("curriculum_learning", {})),
        dynamic_batching=DynamicBatchingConfig(**dynamic),
    )


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def data_efficiency_config(section: Any) -> DataEfficiencyConfig:
    """The validated ``data_efficiency`` section (None: the defaults, off).

    Raises:
        ConfigError: an unknown key, a bad value, or a missing key an enabled feature
            needs (named).
    """
    if section is None:
        return DataEfficiencyConfig()
    path = "data_efficiency"
    section = check_keys(path, section, {"enabled", "seed", "data_sampling", "data_routing"})
    routing = check_keys(f"{path}.data_routing", section.get("data_routing", {}), {"enabled", "random_ltd"})
    random_ltd = routing.get("random_ltd", {})
    if not isinstance(random_ltd, Mapping):
        raise ConfigError(f"'{path}.data_routing.random_ltd' must be a JSON object, got {random_ltd!r}")
    if as_bool(f"{path}.data_routing.random_ltd.enabled", random_ltd.get("enabled", False)):
        # imported here: the data_pipeline package imports the runtime, which imports the config
        from shardwise.runtime.data_pipeline.data_routing._config import parse_random_ltd

        parse_random_ltd(random_ltd)
    config = DataEfficiencyConfig(
        enabled=as_bool(f"{path}.enabled", section.get("enabled", False)),
        seed=as_int(f"{path}.seed", section.get("seed", 1234)),
        data_sampling=_data_sampling(f"{path}.data_sampling", section.get("data_sampling", {})),
        data_routing=DataRoutingConfig(
            enabled=as_bool(f"{path}.data_routing.enabled", routing.get("enabled", False)), random_ltd=random_ltd
        ),
    )
    return config
