"""Host memory figures that stand in for device memory when the accelerator is the CPU.

DeepSpeed's CPU accelerator reports the process's resident set size (RSS) as "allocated"
and "reserved" memory and physical RAM as the device's total; these helpers do the same
without a psutil dependency (Linux procfs, with a getrusage fallback elsewhere).
"""

from __future__ import annotations

import os
import resource
import sys


class HostMemory:
    """This process's RSS and the largest RSS seen since the last reset.

    Like DeepSpeed's CPU accelerator the peak is the largest value sampled by these
    calls, not the operating system's high-water mark (which cannot be reset). It is
    process-wide because ``get_accelerator()`` returns a new object on every call.
    """

    def __init__(self) -> None:
        self.peak = 0

    def current(self) -> int:
        """Resident set size now, in bytes; also updates the peak."""
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # no procfs (macOS): the OS peak is the best available figure
            scale = 1 if sys.platform == "darwin" else 1024
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        self.peak = max(self.peak, rss)
        return rss

    def max(self) -> int:
        """The largest RSS sampled since the last reset, now included."""
        self.current()
        return self.peak

    def reset(self) -> None:
        """Restart the peak from the current RSS."""
        self.peak = 0
        self.current()


host_memory = HostMemory()


def host_total() -> int:
    """Physical RAM in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_available() -> int:
    """RAM the kernel estimates can be allocated without swapping (MemAvailable), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
