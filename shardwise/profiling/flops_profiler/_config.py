"""``FlopsProfilerConfig``: the ``flops_profiler`` section of a DeepSpeed config."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlopsProfilerConfig:
    """When and how the engine profiles one training step (DeepSpeed's keys and defaults)."""

    enabled: bool = False
    """Profile the training step ``profile_step``."""
    profile_step: int = 1
    """The engine's ``global_steps`` value (0 for the first step) of the profiled step;
    a later step than the first keeps one-time costs out of the latencies."""
    module_depth: int = -1
    """Deepest module level printed (the model is 0); -1 prints all."""
    top_modules: int = 1
    """Module classes listed per depth in the top-modules section."""
    detailed: bool = True
    """Print the module tree with each module's numbers."""
    output_file: str | None = None
    """Write the profile to this file instead of stdout."""
    recompute_fwd_factor: float = 0.0
    """DeepSpeed's share of the forward recomputed in backward. Backward FLOPs are measured
    (recomputation included), so a nonzero value is reported as unused."""

    def __post_init__(self):
        if isinstance(self.profile_step, bool) or not isinstance(self.profile_step, int) or self.profile_step < 0:
            raise ValueError(f"flops_profiler.profile_step must be an integer >= 0, got {self.profile_step!r}")
        if isinstance(self.module_depth, bool) or not isinstance(self.module_depth, int) or self.module_depth < -1:
            raise ValueError(f"flops_profiler.module_depth must be -1 (all levels) or >= 0, "
                             f"got {self.module_depth!r}")
        if isinstance(self.top_modules, bool) or not isinstance(self.top_modules, int) or self.top_modules < 1:
            raise ValueError(f"flops_profiler.top_modules must be an integer >= 1, got {self.top_modules!r}")
        if not isinstance(self.recompute_fwd_factor, (int, float)) or self.recompute_fwd_factor < 0:
            raise ValueError(f"flops_profiler.recompute_fwd_factor must be a number >= 0, "
                             f"got {self.recompute_fwd_factor!r}")
