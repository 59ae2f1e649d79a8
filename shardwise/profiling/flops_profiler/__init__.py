"""The FLOPs profiler, at DeepSpeed's path ``deepspeed.profiling.flops_profiler``.

``get_model_profile`` profiles one call of a model; ``FlopsProfiler`` profiles whatever
runs between ``start_profile`` and ``stop_profile``; ``StepProfiler`` is the engine's hook
for the ``flops_profiler`` config section. FLOPs come from
``torch.utils.flop_counter.FlopCounterMode`` (see [Note: how FLOPs are counted] in
``_profiler.py``); the printed text keeps DeepSpeed's layout (see [Note: the profile's
text is an interface] in ``_report.py``).
"""

from shardwise.config._monitor import FlopsProfilerConfig
from shardwise.profiling.flops_profiler._model_profile import get_model_profile
from shardwise.profiling.flops_profiler._profiler import FlopsProfiler, StepTiming
from shardwise.profiling.flops_profiler._step import StepProfiler
from shardwise.profiling.flops_profiler._units import (
    DEFAULT_PRECISION,
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "DEFAULT_PRECISION",
    "FlopsProfiler",
    "FlopsProfilerConfig",
    "StepProfiler",
    "StepTiming",
    "bytes_to_string",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
