"""What the bench scripts share about the machine they report: the CPU's name and a
median that tolerates an empty list. Imported by the scripts as ``_machine`` (they run as
``python bench/<script>.py``, so this folder is on the path)."""

import platform
import statistics
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def median_or_nan(values) -> float:
    """The median of ``values``; NaN for none."""
    values = list(values)
    return statistics.median(values) if values else float("nan")
