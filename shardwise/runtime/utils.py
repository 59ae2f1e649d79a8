"""DeepSpeed's ``deepspeed.runtime.utils`` helpers that training scripts call."""

from __future__ import annotations

import gc
import logging
import random

import torch
import torch.distributed as dist

from shardwise.accelerator import get_accelerator

logger = logging.getLogger("shardwise")


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every device) with ``seed``."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def move_to_device(item, device, criterion_func=None):
    """``item`` with every tensor in it (through lists, tuples and dicts) moved to ``device``;
    with ``criterion_func``, only the tensors for which it returns True."""
    if torch.is_tensor(item):
        return item.to(device) if criterion_func is None or criterion_func(item) else item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log device and host memory use on rank 0 under ``message``; only when ``force``
    (DeepSpeed's switch, so calls can stay in code), and resets the device's peak."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    accelerator = get_accelerator()
    gib = 2**30
    logger.info(
        "%s | device memory allocated %.2f GiB, max allocated %.2f GiB, reserved %.2f GiB",
        message,
        accelerator.memory_allocated() / gib,
        accelerator.max_memory_allocated() / gib,
        accelerator.memory_reserved() / gib,
    )
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        vm = psutil.virtual_memory()
        logger.info("%s | host memory used %.2f GiB (%.1f%%)", message, (vm.total - vm.available) / gib, vm.percent)
    accelerator.reset_max_memory_allocated()
