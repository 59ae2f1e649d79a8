"""DeepSpeed's module path ``deepspeed.profiling.flops_profiler.profiler``: an alias of
``shardwise.profiling.flops_profiler`` (the code lives in its ``_`` modules)."""

from shardwise.profiling.flops_profiler import *  # noqa: F401,F403
from shardwise.profiling.flops_profiler import __all__  # noqa: F401
