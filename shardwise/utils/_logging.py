"""``log_dist`` and friends: log on chosen ranks through the ``shardwise`` logger."""

from __future__ import annotations

import functools
import logging

import torch.distributed as dist

logger = logging.getLogger("shardwise")
"""The library's logger (DeepSpeed scripts use it as ``deepspeed.utils.logger``)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _selected(ranks) -> bool:
    """DeepSpeed's rule: None or ``[-1]`` means every rank, else the ranks listed."""
    if ranks is None:
        ranks = [-1]
    return -1 in ranks or _rank() in ranks


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log ``message`` as ``[Rank R] message`` on the ``ranks`` given (None or [-1]: all)."""
    if _selected(ranks):
        logger.log(level, "[Rank %d] %s", _rank(), message)


@functools.lru_cache(None)
def _log_once(message: str, ranks: tuple | None, level: int) -> None:
    log_dist(message, ranks=list(ranks) if ranks is not None else None, level=level)


def log_dist_once(message: str, ranks=None, level: int = logging.INFO) -> None:
    """``log_dist``, but each distinct message only the first time."""
    _log_once(message, tuple(ranks) if ranks is not None else None, level)


def print_dist(message: str, ranks=None) -> None:
    """Print ``message`` as ``[Rank R] message`` on the ``ranks`` given (None or [-1]: all)."""
    if _selected(ranks):
        print(f"[Rank {_rank()}] {message}", flush=True)


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    """Set the logger's level by name (``"debug"``, ``"info"``, ``"warning"``...)."""
    level = getattr(logging, log_level_str.upper(), None)
    if not isinstance(level, int):
        raise ValueError(f"unknown log level {log_level_str!r}; use debug, info, warning, error or critical")
    (custom_logger or logger).setLevel(level)


def warning_once(*args, **kwargs) -> None:
    """``logger.warning`` that prints each distinct message once (DeepSpeed's ``logger.warning_once``)."""
    _warn_once(args, tuple(sorted(kwargs.items())))


@functools.lru_cache(None)
def _warn_once(args: tuple, kwargs: tuple) -> None:
    logger.warning(*args, **dict(kwargs))


logger.warning_once = warning_once
