"""The one adapter from DeepSpeed-style JSON (dict or file) to a validated TrainConfig.

Only this module knows DeepSpeed's key names, legacy aliases and "auto" values; the
rest of shardwise sees typed dataclasses.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

from shardwise.config._autotuning import autotuning_config
from shardwise.config._components import (
    OPTIMIZERS,
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
from shardwise.config._compression import compression_config
from shardwise.config._data_efficiency import (
    data_efficiency_config,
    legacy_curriculum_config,
    progressive_layer_drop_config,
)
from shardwise.config._errors import AUTO, ConfigError, as_bool, as_choice, as_int, check_keys, unknown_key_error
from shardwise.config._hybrid_engine import hybrid_engine_config
from shardwise.config._later import LATER_SCALARS, LATER_SECTIONS, check_later_scalar, check_later_section
from shardwise.config._monitor import (
    CometConfig,
    CommsLoggerConfig,
    FileMonitorConfig,
    FlopsProfilerConfig,
    MonitorConfig,
    WandbConfig,
)
from shardwise.config._no_effect import known_keys, log_no_effect, take_special_keys
from shardwise.config._train import TrainConfig

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_MONITOR_SECTIONS = {
    "tensorboard": FileMonitorConfig,
    "csv_monitor": FileMonitorConfig,
    "wandb": WandbConfig,
    "comet": CometConfig,
    "flops_profiler": FlopsProfilerConfig,
    "comms_logger": CommsLoggerConfig,
}
_SECTIONS = {
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "zero_optimization",
    "checkpoint",
    "data_types",
    "comm",
    "aio",
    "activation_checkpointing",
    "hybrid_engine",
    "curriculum_learning",
    "progressive_layer_drop",
    "data_efficiency",
    "autotuning",
} | set(_MONITOR_SECTIONS)
_TOP_SCALARS = {f.name for f in dataclasses.fields(TrainConfig)} - {
    "batch",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "zero",
    "checkpoint",
    "data_types",
    "comm",
    "aio",
    "raw",
    "activation_checkpointing",
    "monitor",
    "hybrid_engine",
    "curriculum_learning",
    "progressive_layer_drop",
    "data_efficiency",
    "compression_training",
    "autotuning",
}
_LEGACY_TOP = {"bfloat16": "bf16"}
_LEGACY_ZERO = {
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "allgather_size": "allgather_bucket_size",
}
# DeepSpeed reads its stage-3 keys under their field names too; not deprecated, so no warning.
_ZERO_FIELD_NAMES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
_AUTO_FIELDS = {
    "fp16": {"enabled"},
    "bf16": {"enabled"},
    "zero_optimization": {
        "reduce_bucket_size",
        "allgather_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "sub_group_size",
        "overlap_comm",
        "contiguous_gradients",
    },
}
_UNBUILT_OPTIMIZERS = {
    "muadam": "MuAdam",
    "muadamw": "MuAdamW",
    "musgd": "MuSGD",
    "adafactor": "Adafactor",
    "cpuadam": "DeepSpeedCPUAdam",
    "fusedadam": "FusedAdam",
}


def _read(config: Any) -> dict:
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass the path of a JSON config file or a dict")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"config file {path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
            ) from None
    if isinstance(config, dict):
        return dict(config)
    raise ConfigError(f"config must be a dict, a JSON file path or a TrainConfig, got {type(config).__name__}")


def _coerce(cls, path: str, values: dict) -> dict:
    """Turn integer-valued floats (5e8) into ints for int fields, ints into floats for floats."""
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    out = {}
    for key, value in values.items():
        kind = types.get(key, "")
        if kind.startswith("int") and isinstance(value, float) and value.is_integer():
            value = int(value)
        elif kind.startswith("float") and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        out[key] = value
    return out


def _section(cls, path: str, section: Any, noted: list[str], *, aliases: dict | None = None):
    aliases = aliases or {}
    fields = {f.name for f in dataclasses.fields(cls)}
    section = dict(check_keys(path, section, fields | set(aliases) | known_keys(path)))
    for old, new in aliases.items():
        if old in section:
            warnings.warn(
                f"config key '{path}.{old}' is deprecated; use '{path}.{new}'", DeprecationWarning, stacklevel=4
            )
            section.setdefault(new, section.pop(old))
    enabled = section.get("enabled", False) in (True, AUTO) if path in ("fp16", "bf16") else True
    take_special_keys(path, section, noted, enabled=enabled)
    section = {k: v for k, v in section.items() if k in fields}
    for key, value in list(section.items()):
        if value == AUTO:
            if key not in _AUTO_FIELDS.get(path, ()):
                raise ConfigError(f'{path}.{key} does not accept "auto"; give a value')
            del section[key]  # "auto" means: take the default
    return cls(**_coerce(cls, path, section))


def _drop_auto(params: Any, path: str) -> dict:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ConfigError(f"{path} must be a JSON object, got {params!r}")
    return {k: v for k, v in params.items() if v != AUTO}


def _optimizer(section: Any) -> OptimizerConfig:
    check_keys("optimizer", section, {"type", "params", "legacy_fusion"})
    name = section.get("type")
    if not isinstance(name, str):
        raise ConfigError(f'optimizer.type must be a string such as "AdamW", got {name!r}')
    key = name.lower()
    if key in _UNBUILT_OPTIMIZERS:
        raise ConfigError(
            f"optimizer.type {name!r} is not available in this version of shardwise yet; "
            f"available: Adam, AdamW, SGD, Adagrad, Lamb, Lion, OneBitAdam, ZeroOneAdam, OneBitLamb"
        )
    canonical = as_choice("optimizer.type", name, OPTIMIZERS)
    return OptimizerConfig(type=canonical, params=_drop_auto(section.get("params"), "optimizer.params"))


def _scheduler(section: Any) -> SchedulerConfig:
    check_keys("scheduler", section, {"type", "params"})
    return SchedulerConfig(type=section.get("type"), params=_drop_auto(section.get("params"), "scheduler.params"))


def _batch_value(raw: dict, key: str) -> int | None:
    value = raw.get(key)
    if value is None or value == AUTO:
        return None
    return as_int(key, value, minimum=1)


def resolve_batch(raw: dict, world_size: int) -> BatchConfig:
    """Complete train_batch_size = micro x accumulation x world_size from what is given."""
    world_size = as_int("world_size", world_size, minimum=1)
    total, micro, gas = (_batch_value(raw, k) for k in _BATCH_KEYS)
    if total is not None and micro is not None and gas is not None:
        if total != micro * gas * world_size:
            raise ConfigError(
                f"train_batch_size ({total}) != train_micro_batch_size_per_gpu ({micro}) * "
                f"gradient_accumulation_steps ({gas}) * data-parallel world size ({world_size}) = "
                f"{micro * gas * world_size}; fix one of the three or leave one out to derive it"
            )
    elif total is not None and micro is not None:
        if total % (micro * world_size):
            raise ConfigError(
                f"train_batch_size ({total}) is not divisible by train_micro_batch_size_"
                f"per_gpu ({micro}) * data-parallel world size ({world_size})"
            )
        gas = total // (micro * world_size)
    elif total is not None and gas is not None:
        if total % (gas * world_size):
            raise ConfigError(
                f"train_batch_size ({total}) is not divisible by gradient_accumulation_"
                f"steps ({gas}) * data-parallel world size ({world_size})"
            )
        micro = total // (gas * world_size)
    elif total is not None:
        if total % world_size:
            raise ConfigError(
                f"train_batch_size ({total}) is not divisible by the data-parallel "
                f"world size ({world_size}); set train_micro_batch_size_per_gpu too"
            )
        micro, gas = total // world_size, 1
    elif micro is not None:
        gas = gas or 1
    else:
        raise ConfigError("set train_batch_size or train_micro_batch_size_per_gpu (or both); the config gives neither")
    return BatchConfig(
        train_batch_size=micro * gas * world_size, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas
    )


def load_config(config: Any, *, world_size: int) -> TrainConfig:
    """Read a DeepSpeed-style config (dict, JSON path or TrainConfig) into a TrainConfig.

    Args:
        config: the config; a TrainConfig is returned as is.
        world_size: the data-parallel size the batch-size triangle is resolved for.

    Raises:
        ConfigError: an unknown key (with the closest valid one), a bad value (with the key
            path and what is allowed), inconsistent batch sizes, or a feature not built yet.
    """
    if isinstance(config, TrainConfig):
        return config
    raw = _read(config)
    for old, new in _LEGACY_TOP.items():
        if old in raw:
            warnings.warn(f"config key '{old}' is deprecated; use '{new}'", DeprecationWarning, stacklevel=2)
            if new in raw:
                raise ConfigError(f"config has both '{old}' and '{new}'; keep only '{new}'")
            raw[new] = raw.pop(old)
    valid = (
        set(_BATCH_KEYS)
        | _SECTIONS
        | _TOP_SCALARS
        | set(LATER_SECTIONS)
        | LATER_SCALARS
        | known_keys("")
        | {"memory_breakdown"}
    )
    noted: list[str] = []
    _drop_dotted_keys(raw, valid, noted)
    for key, value in raw.items():
        if key not in valid:
            raise unknown_key_error("", key, valid)
        if key in LATER_SECTIONS:
            check_later_section(key, value)
        elif key in LATER_SCALARS:
            check_later_scalar(key, value)
    take_special_keys("", raw, noted)
    scalars = {k: raw[k] for k in _TOP_SCALARS if k in raw}
    if scalars.get("gradient_clipping") == AUTO:
        del scalars["gradient_clipping"]
    if scalars.get("steps_per_print") == float("inf"):  # DeepSpeed's "never" (Accelerate sets it)
        scalars["steps_per_print"] = None
    for key, value in scalars.items():
        if value == AUTO:
            raise ConfigError(f'{key} does not accept "auto"; give a value')
    config = TrainConfig(
        batch=resolve_batch(raw, world_size),
        optimizer=_optimizer(raw["optimizer"]) if raw.get("optimizer") is not None else None,
        scheduler=_scheduler(raw["scheduler"]) if raw.get("scheduler") is not None else None,
        fp16=_section(FP16Config, "fp16", raw.get("fp16", {}), noted),
        bf16=_section(BF16Config, "bf16", raw.get("bf16", {}), noted),
        zero=_zero(raw.get("zero_optimization", {}), noted),
        aio=_section(AioConfig, "aio", raw.get("aio") or {}, noted, aliases={"thread_count": "intra_op_parallelism"}),
        checkpoint=_checkpoint(raw.get("checkpoint", {}), noted),
        data_types=_section(DataTypesConfig, "data_types", raw.get("data_types", {}), noted),
        comm=_section(CommConfig, "comm", raw.get("comm", {}), noted),
        activation_checkpointing=_activation_checkpointing(raw),
        monitor=_monitor(raw, noted),
        hybrid_engine=hybrid_engine_config(raw.get("hybrid_engine")),
        curriculum_learning=legacy_curriculum_config(raw.get("curriculum_learning")),
        progressive_layer_drop=progressive_layer_drop_config(raw.get("progressive_layer_drop")),
        data_efficiency=data_efficiency_config(raw.get("data_efficiency")),
        compression_training=compression_config(raw.get("compression_training")),
        autotuning=autotuning_config(raw.get("autotuning")),
        raw=raw,
        **_coerce(TrainConfig, "", scalars),
    )
    log_no_effect(noted)
    return config


def _drop_dotted_keys(raw: dict, valid: set, noted: list[str]) -> None:
    """Remove top-level keys that name a section's key with a dot ("zero_optimization.
    reduce_bucket_size"), noting each: DeepSpeed reads only whole sections at the top level
    and ignores them, and TRL's ``prepare_deepspeed`` writes them into the reference
    model's config, so refusing them would stop every TRL trainer under ZeRO-3."""
    for key in [k for k in raw if k not in valid and k.partition(".")[0] in valid and k.partition(".")[2]]:
        del raw[key]
        noted.append(f"{key} (a section's key written at the top level; DeepSpeed ignores it there too)")


def activation_checkpointing_config(config: Any) -> ActivationCheckpointingConfig:
    """The validated ``activation_checkpointing`` section of a DeepSpeed-style config (dict,
    JSON path or TrainConfig); the rest of the config is not read, so a file that holds
    only this section is enough (``deepspeed.checkpointing.configure`` reads it this way)."""
    if isinstance(config, TrainConfig):
        return config.activation_checkpointing
    return _activation_checkpointing(_read(config))


def _activation_checkpointing(raw: dict) -> ActivationCheckpointingConfig:
    section = raw.get("activation_checkpointing")
    return _section(ActivationCheckpointingConfig, "activation_checkpointing", {} if section is None else section, [])


def _monitor(raw: dict, noted: list[str]) -> MonitorConfig:
    sections = {}
    for key, cls in _MONITOR_SECTIONS.items():
        section = raw.get(key)
        if section is None:
            continue
        check_keys(key, section, {f.name for f in dataclasses.fields(cls)})
        if cls is FileMonitorConfig:
            as_bool(f"{key}.enabled", section.get("enabled", False))
            for name in ("output_path", "job_name"):
                if not isinstance(section.get(name, ""), str):
                    raise ConfigError(f"{key}.{name} must be a string, got {section[name]!r}")
        sections[key] = _section(cls, key, section, noted)
    breakdown = as_bool("memory_breakdown", raw.get("memory_breakdown", False))
    return MonitorConfig(**sections, memory_breakdown=breakdown)


def _zero(section: Any, noted: list[str]) -> ZeroConfig:
    path = "zero_optimization"
    fields = {f.name for f in dataclasses.fields(ZeroConfig)}
    section = dict(
        check_keys(
            path,
            section,
            fields | set(_LEGACY_ZERO) | set(_ZERO_FIELD_NAMES) | known_keys(path) | {"cpu_offload_param"},
        )
    )
    for name, key in _ZERO_FIELD_NAMES.items():
        if name in section:
            if key in section:
                raise ConfigError(f"config has both '{path}.{name}' and '{path}.{key}' (the same setting); keep one")
            section[key] = section.pop(name)
    _legacy_param_offload(section)
    for key, cls in (("offload_optimizer", OffloadOptimizerConfig), ("offload_param", OffloadParamConfig)):
        if key in section:
            value = section.pop(key)
            if value is not None:  # null: not offloaded, as DeepSpeed reads it
                if isinstance(value, dict) and value.get("nvme_path", "") is None:  # DeepSpeed's default
                    value = {k: v for k, v in value.items() if k != "nvme_path"}
                section[key] = _section(cls, f"{path}.{key}", value, noted)
    return _section(ZeroConfig, path, section, noted, aliases=_LEGACY_ZERO)


def _legacy_param_offload(section: dict) -> None:
    """DeepSpeed's deprecated ``cpu_offload_param: true`` is ``offload_param.device = cpu``."""
    if "cpu_offload_param" not in section:
        return
    value = section.pop("cpu_offload_param")
    if value is None:
        return
    as_bool("zero_optimization.cpu_offload_param", value)
    warnings.warn(
        "config key 'zero_optimization.cpu_offload_param' is deprecated; use 'zero_optimization.offload_param'",
        DeprecationWarning,
        stacklevel=5,
    )
    if value and section.get("offload_param") is None:
        section["offload_param"] = {"device": "cpu"}


def _checkpoint(section: Any, noted: list[str]) -> CheckpointConfig:
    fields = {f.name for f in dataclasses.fields(CheckpointConfig)}
    section = dict(check_keys("checkpoint", section, fields | known_keys("checkpoint")))
    take_special_keys("checkpoint", section, noted)
    section = {k: v for k, v in section.items() if k in fields}
    if "tag_validation" in section:
        section["tag_validation"] = as_choice(
            "checkpoint.tag_validation", section["tag_validation"], ("Ignore", "Warn", "Fail")
        )
    if section.get("parallel_write") is not None:
        write = check_keys("checkpoint.parallel_write", section["parallel_write"], {"pipeline_stage"})
        if not as_bool("checkpoint.parallel_write.pipeline_stage", write.get("pipeline_stage", False)):
            section["parallel_write"] = None  # nothing asked for
    if "use_node_local_storage" in section:
        as_bool("checkpoint.use_node_local_storage", section["use_node_local_storage"])
    return CheckpointConfig(**section)
