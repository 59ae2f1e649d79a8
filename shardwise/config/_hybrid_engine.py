"""The ``hybrid_engine`` section: DeepSpeed's Hybrid Engine (train and generate with the
same, current weights), DeepSpeed 0.19.8's keys and defaults. Read by
``runtime/hybrid_engine.py``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shardwise.config._errors import ConfigError, as_bool, as_int, check_keys


@dataclass(frozen=True, kw_only=True)
class HybridEngineConfig:
    """``hybrid_engine``: whether ``initialize`` returns the hybrid engine, and how it
    generates."""

    enabled: bool = False
    """Return a :class:`~shardwise.runtime.hybrid_engine.HybridEngine` (``generate``,
    ``eval``, ``train``; ``engine.module.generate`` goes through it)."""
    max_out_tokens: int = 512
    """The longest sequence (prompt plus new tokens) one ``generate`` may reach; longer is an
    error before anything runs."""
    inference_tp_size: int = 1
    """Ranks (consecutive blocks of the world) that generate together, each holding a
    tensor-parallel slice of the weights; must divide the world size. 1: each rank
    generates its own batch alone. Above 1, a sampling group draws from its first rank's
    random stream."""
    release_inference_cache: bool = False
    """Free the KV cache after every ``generate`` (otherwise it is kept and reused by the
    next call of the same batch size and length)."""
    pin_parameters: bool = True
    """Keep the inference copy of the weights between ``generate`` calls (refreshed in place
    from the current weights at each call); false frees it after each call, so it is built
    again at the next one."""
    tp_gather_partition_size: int = 8
    """Under ZeRO stage 3, the layers gathered at once while the inference copy is filled
    (fewer: less memory in flight; more: fewer, larger all-gathers)."""
    enable_cuda_graph: bool = False
    """Capture the decode steps as CUDA graphs (a GPU only; no effect on the CPU)."""

    def __post_init__(self) -> None:
        for name in ("enabled", "release_inference_cache", "pin_parameters", "enable_cuda_graph"):
            as_bool(f"hybrid_engine.{name}", getattr(self, name))
        as_int("hybrid_engine.max_out_tokens", self.max_out_tokens, minimum=1)
        as_int("hybrid_engine.inference_tp_size", self.inference_tp_size, minimum=1)
        as_int("hybrid_engine.tp_gather_partition_size", self.tp_gather_partition_size, minimum=1)

    def check_world(self, world_size: int) -> None:
        """Refuse an ``inference_tp_size`` that does not divide ``world_size`` ranks."""
        size = self.inference_tp_size
        if world_size % size:
            raise ConfigError(
                f"hybrid_engine.inference_tp_size={size} does not divide the {world_size} rank(s): each "
                "inference tensor-parallel group needs inference_tp_size ranks; change it or the number of processes"
            )


def hybrid_engine_config(section: Any) -> HybridEngineConfig:
    """The validated ``hybrid_engine`` section (None: the defaults, off); unknown keys are
    refused with the closest valid one."""
    if section is None:
        return HybridEngineConfig()
    fields = {f.name for f in dataclasses.fields(HybridEngineConfig)}
    section = check_keys("hybrid_engine", section, fields)
    values = dict(section)
    for name in ("max_out_tokens", "inference_tp_size", "tp_gather_partition_size"):
        value = values.get(name)
        if isinstance(value, float) and value.is_integer():
            values[name] = int(value)
    return HybridEngineConfig(**values)
