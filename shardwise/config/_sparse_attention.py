"""The ``sparse_attention`` section: which block-sparse layout a model's attention uses.

DeepSpeed reads the section into a dict holding ``mode``, ``block`` and the keys of that
mode, with its defaults filled in (``DeepSpeedConfig.sparse_attention``); a model script
turns it into a sparsity config (``shardwise.ops.sparse_attention.sparsity_config_from_dict``
or ``engine.sparse_attention_config(num_heads)``). Pure Python: no torch here.
"""

from __future__ import annotations

import logging
from typing import Any

from shardwise.config._errors import ConfigError, as_bool, as_choice, as_int, check_keys

logger = logging.getLogger("shardwise")

_COMMON = {"block": 16, "different_layout_per_head": False}
MODE_KEYS: dict[str, dict[str, Any]] = {
    "dense": {"block": 16},
    "fixed": {
        **_COMMON,
        "num_local_blocks": 4,
        "num_global_blocks": 1,
        "attention": "bidirectional",
        "horizontal_global_attention": False,
        "num_different_global_patterns": 1,
    },
    "variable": {
        **_COMMON,
        "num_random_blocks": 0,
        "local_window_blocks": [4],
        "global_block_indices": [0],
        "global_block_end_indices": None,
        "attention": "bidirectional",
        "horizontal_global_attention": False,
    },
    "bigbird": {**_COMMON, "num_random_blocks": 0, "num_sliding_window_blocks": 3, "num_global_blocks": 1},
    "bslongformer": {
        **_COMMON,
        "num_sliding_window_blocks": 3,
        "global_block_indices": [0],
        "global_block_end_indices": None,
    },
}
"""Each mode's keys and DeepSpeed's defaults for them (``mode`` defaults to "fixed")."""

_ALL_KEYS = {"mode"} | {key for keys in MODE_KEYS.values() for key in keys}


def _checked(key: str, value: Any) -> Any:
    path = f"sparse_attention.{key}"
    if key in ("different_layout_per_head", "horizontal_global_attention"):
        return as_bool(path, value)
    if key == "attention":
        return as_choice(path, value, ("bidirectional", "unidirectional"))
    if key in ("local_window_blocks", "global_block_indices", "global_block_end_indices"):
        if value is None and key == "global_block_end_indices":
            return None
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{path} must be a non-empty list of integers, got {value!r}")
        return [as_int(path, item, minimum=0 if key != "local_window_blocks" else 1) for item in value]
    return as_int(
        path,
        value,
        minimum=1
        if key in ("block", "num_local_blocks", "num_different_global_patterns", "num_sliding_window_blocks")
        else 0,
    )


def sparse_attention_section(section: Any) -> dict[str, Any] | None:
    """Validate a ``sparse_attention`` section and return DeepSpeed's dict for it.

    The result holds ``mode`` and exactly that mode's keys, defaults filled in. Keys that
    belong to another mode are accepted, as in DeepSpeed, but named in one warning since
    they change nothing. None stays None (no section).
    """
    if section is None:
        return None
    check_keys("sparse_attention", section, _ALL_KEYS)
    mode = section.get("mode", "fixed")
    if mode not in MODE_KEYS:
        raise ConfigError(
            f"sparse_attention.mode={mode!r} is not one of {list(MODE_KEYS)}; "
            "for a sliding window without global blocks use mode 'bslongformer'"
        )
    resolved = {"mode": mode}
    for key, default in MODE_KEYS[mode].items():
        resolved[key] = _checked(key, section.get(key, default))
    unused = sorted(set(section) - set(resolved))
    if unused:
        logger.warning("sparse_attention keys with no effect in mode %r: %s", mode, ", ".join(unused))
    return resolved
