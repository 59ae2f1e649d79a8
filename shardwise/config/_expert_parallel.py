"""DeepSpeed's ``"expert_parallel"`` section (AutoEP), checked here and applied by
``moe/_autoep.py`` (see [Note: expert parallelism for Hugging Face models] there)."""

from __future__ import annotations

from shardwise.config._errors import ConfigError

_DEFAULTS = {
    "enabled": False,
    "autoep_size": 1,
    "expert_tensor_parallel_size": 1,
    "preset_model": None,
    "use_grouped_mm": True,
    "disable_triton_grouped_mm": False,
    "moe_layer_pattern": None,
    "router_pattern": None,
    "expert_pattern": None,
    "score_func": "auto",
    "score_apply": "auto",
    "route_norm": None,
    "route_scale": 1.0,
    "top_k": "auto",
    "routed_scaling_factor": "auto",
    "num_expert_groups": None,
    "num_limited_groups": None,
    "load_balance_coeff": None,
    "expert_w1": None,
    "expert_w2": None,
    "expert_w3": None,
    "num_experts_attr": None,
    "top_k_attr": None,
    "has_shared_experts": None,
    "shared_experts_pattern": None,
}
"""DeepSpeed 0.19.8's keys and defaults."""

_NO_EFFECT = {"use_grouped_mm", "disable_triton_grouped_mm"}
"""Kernel choices: the model's own experts implementation computes the local experts."""

_ROUTING = set(_DEFAULTS) - {"enabled", "autoep_size", "preset_model", "moe_layer_pattern", "expert_pattern"}
_ROUTING -= _NO_EFFECT
"""Keys that would change the model's routing or expert layout: only their defaults."""

PRESETS = {
    "mixtral": "MixtralSparseMoeBlock",
    "qwen2_moe": "Qwen2MoeSparseMoeBlock",
    "qwen3_moe": "Qwen3MoeSparseMoeBlock",
}
"""``preset_model`` names and the MoE block class of each family."""


def check_expert_parallel(section: dict) -> dict:
    """The section with DeepSpeed's defaults filled in; unknown keys, bad values and
    routing overrides (shardwise keeps the model's own router) are errors."""
    unknown = sorted(set(section) - set(_DEFAULTS))
    if unknown:
        raise ConfigError(f"expert_parallel: unknown key(s) {unknown}; valid keys: {sorted(_DEFAULTS)}")
    values = {**_DEFAULTS, **section}
    if values["enabled"] not in (True, False):
        raise ConfigError(f"expert_parallel.enabled must be true or false, got {values['enabled']!r}")
    size = values["autoep_size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"expert_parallel.autoep_size must be a positive integer, got {size!r}")
    if values["preset_model"] is not None and values["preset_model"] not in PRESETS:
        raise ConfigError(
            f"expert_parallel.preset_model={values['preset_model']!r} is not one shardwise knows; use one of "
            f"{sorted(PRESETS)} or leave it out (the MoE blocks are found by their stacked experts)"
        )
    changed = sorted(k for k in _ROUTING if values[k] != _DEFAULTS[k])
    if values["enabled"] and changed:
        raise ConfigError(
            f"expert_parallel: {changed} would change the model's routing or expert layout; shardwise's AutoEP "
            "keeps the model's own router and experts and only splits them over ranks: remove these keys"
        )
    return values
