"""Profilers of a model's work, at DeepSpeed's path ``deepspeed.profiling``.

``flops_profiler``: FLOPs, MACs, parameters and latency of a model and its modules.
"""

from shardwise.profiling import flops_profiler

__all__ = ["flops_profiler"]
