"""Numbers as the short suffixed strings of DeepSpeed's FLOPs profiler ("1.5 G", "2 ms").

Tools parse the profiler's text, so the format is DeepSpeed's: the value divided by the
largest scale it reaches, rounded to ``precision`` decimals and printed with ``:g`` (no
trailing zeros), a space, then the suffix: T, G, M, K for 1e12 .. 1e3, none for 1 and for
zero, m and u below 1 (milli, micro). ``params_to_string`` says B (billions) for G.
"""

from __future__ import annotations

DEFAULT_PRECISION = 2
"""Decimals kept by the ``*_to_string`` helpers."""

_SCALES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0), ("m", 1e-3), ("u", 1e-6))


def _pick_scale(num: float) -> tuple[str, float]:
    if num == 0:
        return "", 1.0
    for suffix, scale in _SCALES:
        if abs(num) >= scale:
            return suffix, scale
    return _SCALES[-1]


def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``num`` with a magnitude suffix, e.g. ``number_to_string(1.5e9) == "1.5 G"``.

    Args:
        num: the value.
        units: force a suffix (``"T"``, ``"G"``, ``"M"``, ``"K"``, ``"m"``, ``"u"``); an
            unknown or empty suffix prints the plain value. None picks the largest scale
            that ``num`` reaches.
        precision: decimals kept after scaling.
    """
    if units is None:
        units, scale = _pick_scale(num)
    else:
        scale = dict(_SCALES).get(units, 1.0)
    return f"{round(num / scale, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Multiply-accumulate count, e.g. ``"3.2 GMACs"`` (arguments as ``number_to_string``)."""
    return f"{number_to_string(macs, units=units, precision=precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """A FLOP count or rate, e.g. ``"81.9 TFLOPS"`` (arguments as ``number_to_string``)."""
    return f"{number_to_string(flops, units=units, precision=precision)}FLOPS"


def bytes_to_string(num_bytes: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """A byte count, e.g. ``"1.2 GB"`` (arguments as ``number_to_string``)."""
    return f"{number_to_string(num_bytes, units=units, precision=precision)}B"


def params_to_string(params_num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """A parameter count, e.g. ``"336.23 M"`` or ``"1.3 B"``: billions are B, not G.

    Args:
        params_num: the count.
        units: force a suffix; ``"B"`` means billions (as ``"G"``).
        precision: decimals kept after scaling.
    """
    if units:
        units = units.replace("B", "G")
    return number_to_string(params_num, units=units, precision=precision).replace("G", "B").strip()


def duration_to_string(duration: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Seconds, e.g. ``"76.67 ms"`` (arguments as ``number_to_string``)."""
    return f"{number_to_string(duration, units=units, precision=precision)}s"
