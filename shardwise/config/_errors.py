"""The config error type and small validators shared by every section."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

AUTO = "auto"


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the key path and the fix."""


def unknown_key_error(path: str, key: str, valid: Iterable[str]) -> ConfigError:
    valid = sorted(valid)
    full = f"{path}.{key}" if path else key
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if match:
        suggestion = f"{path}.{match[0]}" if path else match[0]
        return ConfigError(f"unknown config key '{full}'; did you mean '{suggestion}'?")
    where = f"in '{path}'" if path else "at the top level"
    return ConfigError(f"unknown config key '{full}'; valid keys {where} are: {', '.join(valid)}")


def check_keys(path: str, section: Any, valid: Iterable[str]) -> dict:
    """Require ``section`` to be a JSON object whose keys are all in ``valid``."""
    if not isinstance(section, dict):
        raise ConfigError(f"'{path}' must be a JSON object, got {section!r}")
    valid = set(valid)
    for key in section:
        if key not in valid:
            raise unknown_key_error(path, key, valid)
    return section


def as_bool(path: str, value: Any, *, allow_auto: bool = False, auto: bool = False) -> bool:
    if allow_auto and value == AUTO:
        return auto
    if not isinstance(value, bool):
        extra = ' or "auto"' if allow_auto else ""
        raise ConfigError(f"{path} must be true or false{extra}, got {value!r}")
    return value


def as_int(path: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, float) and value.is_integer():
        value, ok = int(value), True
    if not ok or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if minimum == 1 and maximum is None:
            what = "a positive integer"
        elif minimum == 0 and maximum is None:
            what = "a non-negative integer"
        elif minimum is not None and maximum is not None:
            what = f"an integer from {minimum} to {maximum}"
        else:
            what = "an integer"
        raise ConfigError(f"{path} must be {what}, got {value!r}")
    return value


def as_number(path: str, value: Any, *, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path} must be a number, got {value!r}")
    if minimum is not None and (value < minimum or (strict and value == minimum)):
        relation = ">" if strict else ">="
        raise ConfigError(f"{path} must be {relation} {minimum:g}, got {value!r}")
    return float(value)


def as_choice(path: str, value: Any, choices: Iterable[str], *, case_insensitive: bool = True) -> str:
    choices = list(choices)
    if isinstance(value, str):
        for choice in choices:
            if value == choice or (case_insensitive and value.lower() == choice.lower()):
                return choice
    match = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
    hint = f"; did you mean '{match[0]}'?" if match else ""
    raise ConfigError(f"{path} must be one of {', '.join(choices)}, got {value!r}{hint}")
