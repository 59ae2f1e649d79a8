"""``Monitor`` and ``MonitorMaster``: the event sinks of a training run and the fan-out the
engine writes to (``engine.monitor``), with DeepSpeed's names and semantics.

An event is a tuple ``(tag, value, step)``; the engine's step is the number of samples
seen (``engine.global_samples``). Only global rank 0 builds and writes monitors. A monitor
that fails while writing (disk full, a W&B error) is logged once and switched off: a run
never stops, nor loses a checkpoint, because a dashboard could not be written.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable, Sequence

logger = logging.getLogger("shardwise")

Event = tuple[str, float, int]


def require_package(module: str, what: str, extra: str = "monitor") -> None:
    """Raise ImportError naming the extra to install when ``module`` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"{what} needs the '{module}' package, which is not installed; install it with "
            f"pip install 'shardwise[{extra}]' (or pip install {module}), or disable the section"
        )


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Monitor:
    """One sink of events. Subclasses write ``(tag, value, step)`` tuples somewhere."""

    def __init__(self, monitor_config):
        self.monitor_config = monitor_config
        self.enabled = bool(getattr(monitor_config, "enabled", False))

    def write_events(self, event_list: Sequence[Event]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make what was written durable (a no-op where writes already are)."""

    def close(self) -> None:
        """Flush and release files or runs."""
        self.flush()


class MonitorMaster(Monitor):
    """Every enabled monitor of a ``MonitorConfig``; what ``engine.monitor`` is.

    On global rank 0 the constructor builds the TensorBoard, W&B, CSV and Comet monitors
    whose sections are enabled: their packages are checked on every rank (so a missing one
    fails the whole job at initialize) and their directories made and checked writable on
    rank 0. ``write_events`` fans the events out on rank 0 and does nothing elsewhere.

    Args:
        monitor_config: a ``MonitorConfig`` (``TrainConfig.monitor``).
    """

    def __init__(self, monitor_config):
        super().__init__(monitor_config)
        self.enabled = monitor_config.enabled
        self.tb_monitor = self.wandb_monitor = self.csv_monitor = self.comet_monitor = None
        self._failed: set[str] = set()
        from shardwise.monitor.comet import CometMonitor
        from shardwise.monitor.csv_monitor import csvMonitor
        from shardwise.monitor.tensorboard import TensorBoardMonitor
        from shardwise.monitor.wandb import WandbMonitor

        kinds = (
            ("tb_monitor", monitor_config.tensorboard, TensorBoardMonitor),
            ("wandb_monitor", monitor_config.wandb, WandbMonitor),
            ("csv_monitor", monitor_config.csv_monitor, csvMonitor),
            ("comet_monitor", monitor_config.comet, CometMonitor),
        )
        for _, section, cls in kinds:
            if section.enabled:
                cls.check_available()
        if _global_rank() != 0:
            return
        for attribute, section, cls in kinds:
            if section.enabled:
                setattr(self, attribute, cls(section))

    @property
    def monitors(self) -> list[Monitor]:
        """The monitors built here (none off rank 0)."""
        return [m for m in (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor) if m is not None]

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Write ``(tag, value, step)`` events to every monitor (rank 0 only). Values may be
        Python numbers or one-element tensors."""
        monitors = self.monitors
        if not monitors:
            return
        events = [(tag, float(value), int(step)) for tag, value, step in event_list]
        for monitor in monitors:
            name = type(monitor).__name__
            if name in self._failed:
                continue
            try:
                monitor.write_events(events)
            except Exception as error:  # noqa: BLE001 - a dashboard must not stop training
                self._failed.add(name)
                logger.warning(
                    "%s failed to write events (%s: %s); it is switched off for the rest of "
                    "this run, training continues",
                    name,
                    type(error).__name__,
                    error,
                )

    def flush(self) -> None:
        for monitor in self.monitors:
            try:
                monitor.flush()
            except Exception:  # noqa: BLE001 - see write_events
                pass

    def close(self) -> None:
        for monitor in self.monitors:
            try:
                monitor.close()
            except Exception:  # noqa: BLE001 - see write_events
                pass
