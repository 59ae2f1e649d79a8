"""The ``data_efficiency.data_routing.random_ltd`` section, read into a frozen dataclass.

DeepSpeed 0.19.8 reads this section as a plain dict: only ``enabled`` (false) and
``layer_token_lr_schedule.enabled`` (false) have defaults, every other key is looked up by
name when random-LTD is enabled. ``parse_random_ltd`` requires the same keys, with two
lenient defaults that cannot change results: ``model_mask_name`` (null: the layers take no
mask) and ``schedule_type`` (``fixed_linear``, the only type). ``global_batch_size`` and
``micro_batch_size`` are not user keys in DeepSpeed: its engine writes them in; they are
accepted here so a dict built that way reads too. Pure Python: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise.config._errors import ConfigError, as_bool, as_choice, as_int, check_keys

PATH = "data_efficiency.data_routing.random_ltd"
MODEL_TYPES = ("decoder", "encoder")
HIDDEN_STATE_ORDERS = ("batch_seq_dim", "seq_batch_dim")
SCHEDULE_TYPES = ("fixed_linear",)

_TOP_KEYS = (
    "enabled",
    "total_layer_num",
    "random_ltd_layer_num",
    "random_ltd_layer_id",
    "model_mask_name",
    "model_type",
    "hidden_state_order",
    "random_ltd_schedule",
    "layer_token_lr_schedule",
    "global_batch_size",
    "micro_batch_size",
)
_SCHEDULE_KEYS = ("min_value", "max_value", "schedule_type", "schedule_config")
_STEP_KEYS = ("require_steps", "seq_per_step")
_LR_KEYS = ("enabled", "total_layer_tokens", "warmup_type", "warmup_layer_tokens")


@dataclass(frozen=True, kw_only=True)
class RandomLTDSchedule:
    """``random_ltd_schedule``: the kept length grows linearly from ``min_value`` to
    ``max_value`` over ``require_steps`` steps, rounded down to a multiple of ``seq_per_step``."""

    min_value: int
    """Kept tokens per sample at step 0 (before rounding to ``seq_per_step``)."""
    max_value: int
    """Kept tokens once the ramp ends: the full sequence length; from there nothing drops."""
    require_steps: int
    """Global steps the ramp takes from ``min_value`` to ``max_value``."""
    seq_per_step: int
    """Granularity of the kept length (kept lengths are multiples of it until ``max_value``)."""
    schedule_type: str = "fixed_linear"
    """The only schedule DeepSpeed 0.19.8 implements."""


@dataclass(frozen=True, kw_only=True)
class RandomLTDConfig:
    """The random-LTD section, validated. ``enabled=False`` leaves every other field unset."""

    enabled: bool = False
    """Drop tokens in the chosen layers during training."""
    total_layer_num: int = 0
    """Transformer layers of the model (those converted with ``convert_to_random_ltd``)."""
    random_ltd_layer_id: tuple[int, ...] = ()
    """Which converted layers drop tokens, counted from 0 in module order, ascending."""
    model_mask_name: str | None = None
    """Keyword under which the layer receives its attention mask; None: no mask."""
    model_type: str = "decoder"
    """``decoder`` (causal) or ``encoder``; both gather the mask's kept rows and columns."""
    hidden_state_order: str = "batch_seq_dim"
    """``batch_seq_dim`` ([batch, seq, hidden]) or ``seq_batch_dim`` ([seq, batch, hidden])."""
    schedule: RandomLTDSchedule | None = None
    """The kept-length schedule."""
    global_batch_size: int | None = None
    """Samples per optimizer step (DeepSpeed's engine sets it); counts consumed layer tokens."""
    micro_batch_size: int | None = None
    """Samples per micro-batch per rank (DeepSpeed's engine sets it); informational."""

    @property
    def random_ltd_layer_num(self) -> int:
        """How many layers drop tokens."""
        return len(self.random_ltd_layer_id)


def parse_random_ltd(section: Any) -> RandomLTDConfig:
    """Read and check a ``random_ltd`` section (a dict, or None for absent).

    Raises ConfigError naming the key for unknown keys (with a did-you-mean), missing
    required keys, layer ids outside ``[0, total_layer_num)`` or repeated, a layer count that
    disagrees with the id list, ``min_value > max_value`` and the like, and for
    ``layer_token_lr_schedule.enabled=true``, which DeepSpeed 0.19.8 refuses too.
    """
    if section is None:
        return RandomLTDConfig()
    check_keys(PATH, section, _TOP_KEYS)
    _check_lr_schedule(section.get("layer_token_lr_schedule", {}))
    if not as_bool(f"{PATH}.enabled", section.get("enabled", False)):
        return RandomLTDConfig()
    total = as_int(f"{PATH}.total_layer_num", _required(section, "total_layer_num", PATH), minimum=1)
    ids = _layer_ids(section, total)
    return RandomLTDConfig(
        enabled=True,
        total_layer_num=total,
        random_ltd_layer_id=ids,
        model_mask_name=_mask_name(section.get("model_mask_name")),
        model_type=as_choice(f"{PATH}.model_type", _required(section, "model_type", PATH), MODEL_TYPES),
        hidden_state_order=as_choice(
            f"{PATH}.hidden_state_order", _required(section, "hidden_state_order", PATH), HIDDEN_STATE_ORDERS
        ),
        schedule=_schedule(_required(section, "random_ltd_schedule", PATH)),
        global_batch_size=_optional_int(section, "global_batch_size"),
        micro_batch_size=_optional_int(section, "micro_batch_size"),
    )


def _required(section: dict, key: str, path: str) -> Any:
    if key not in section:
        raise ConfigError(f"{path}.{key} is required when random-LTD is enabled")
    return section[key]


def _optional_int(section: dict, key: str) -> int | None:
    value = section.get(key)
    return None if value is None else as_int(f"{PATH}.{key}", value, minimum=1)


def _mask_name(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{PATH}.model_mask_name must be a keyword name or null, got {value!r}")
    return value


def _layer_ids(section: dict, total: int) -> tuple[int, ...]:
    path = f"{PATH}.random_ltd_layer_id"
    raw = _required(section, "random_ltd_layer_id", PATH)
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ConfigError(f"{path} must be a non-empty list of layer indices, got {raw!r}")
    ids = [as_int(f"{path}[{i}]", value, minimum=0) for i, value in enumerate(raw)]
    outside = [i for i in ids if i >= total]
    if outside:
        raise ConfigError(f"{path} has {outside}, out of range for total_layer_num {total} (ids are 0..{total - 1})")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{path} repeats a layer: {ids}")
    count = as_int(f"{PATH}.random_ltd_layer_num", _required(section, "random_ltd_layer_num", PATH), minimum=1)
    if count != len(ids):
        raise ConfigError(f"{PATH}.random_ltd_layer_num is {count} but random_ltd_layer_id lists {len(ids)} layers")
    return tuple(sorted(ids))


def _schedule(raw: Any) -> RandomLTDSchedule:
    path = f"{PATH}.random_ltd_schedule"
    check_keys(path, raw, _SCHEDULE_KEYS)
    low = as_int(f"{path}.min_value", _required(raw, "min_value", path), minimum=1)
    high = as_int(f"{path}.max_value", _required(raw, "max_value", path), minimum=1)
    kind = as_choice(f"{path}.schedule_type", raw.get("schedule_type", "fixed_linear"), SCHEDULE_TYPES)
    steps = check_keys(f"{path}.schedule_config", _required(raw, "schedule_config", path), _STEP_KEYS)
    require = as_int(f"{path}.schedule_config.require_steps", _required(steps, "require_steps", path), minimum=1)
    per_step = as_int(f"{path}.schedule_config.seq_per_step", _required(steps, "seq_per_step", path), minimum=1)
    if low > high:
        raise ConfigError(f"{path}.min_value ({low}) must be <= max_value ({high})")
    if per_step > low:
        raise ConfigError(
            f"{path}.schedule_config.seq_per_step ({per_step}) must be <= min_value ({low}): the kept "
            f"length is rounded down to a multiple of it, so training would start with 0 kept tokens"
        )
    return RandomLTDSchedule(
        min_value=low, max_value=high, require_steps=require, seq_per_step=per_step, schedule_type=kind
    )


def _check_lr_schedule(raw: Any) -> None:
    path = f"{PATH}.layer_token_lr_schedule"
    check_keys(path, raw, _LR_KEYS)
    if as_bool(f"{path}.enabled", raw.get("enabled", False)):
        raise ConfigError(
            f"{path}.enabled=true is not supported (DeepSpeed 0.19.8 refuses it too); keep it false "
            f"and drive your learning-rate schedule from RandomLTD.consumed_layer_tokens if you need it"
        )
