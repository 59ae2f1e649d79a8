"""``StepProfiler``: the engine's hook that profiles one training step."""

from __future__ import annotations

import contextlib
import enum
import time
from typing import Literal

from torch import nn

from shardwise.accelerator import get_accelerator
from shardwise.config._monitor import FlopsProfilerConfig
from shardwise.profiling.flops_profiler._profiler import FlopsProfiler, StepTiming

Phase = Literal["forward", "backward", "step"]
_PHASES = ("forward", "backward", "step")


class _State(enum.Enum):
    WAITING = "waiting"  # before the profiled step's forward
    RUNNING = "running"  # between that forward's start and the end of its step
    DONE = "done"  # the profile was printed (or abandoned after an error)


class StepProfiler:
    """Profiles the forward, backward and step of the training step ``config.profile_step``.

    Contract: the engine wraps each phase of every micro-step in ``phase(...)``; a
    disabled profiler, or any step but the profiled one, costs a few comparisons. The
    ``forward`` phase of the profiled step starts a ``FlopsProfiler`` (FLOP counter and
    module hooks). Each phase of that micro-step is timed (synchronizing the accelerator
    at its edges on CUDA); the FLOPs counted inside ``backward`` are its backward FLOPs.
    After ``backward`` the counter stops. When the ``step`` phase ends the profile is
    printed with ``print_model_profile`` (to ``config.output_file`` if set); no hook is
    left and the numbers stay readable on ``self.profiler``. One micro-batch is
    profiled: the step's first forward and first backward (with gradient accumulation the
    first micro-batch; under a pipeline schedule, which runs further forwards before the
    first backward, the module hooks come off after the first forward and later phases of
    the step are neither timed nor counted). An error inside a phase abandons the profile.

    The engine's ``ProgressReporter.timer`` drives it (``global_steps`` counts finished
    steps from 0, as in DeepSpeed)::

        with profiler.phase("forward", step=engine.global_steps):
            ...

    Args:
        model: the engine's module.
        config: the ``flops_profiler`` settings.
        engine: the engine, read for the world, data- and model-parallel sizes and the
            micro-batch size printed in the summary; None leaves those lines out.
        enabled: False turns the profiler off on this rank whatever the config says
            (DeepSpeed profiles on global rank 0 only; the others need no hooks, since
            profiling adds no collectives).
    """

    def __init__(self, model: nn.Module, config: FlopsProfilerConfig, *, engine=None, enabled: bool = True):
        self.config = config
        self.profiler = FlopsProfiler(model, ds_engine=engine, recompute_fwd_factor=config.recompute_fwd_factor)
        """The ``FlopsProfiler`` of the profiled step (readable after it printed)."""
        self._state = _State.WAITING if config.enabled and enabled else _State.DONE
        self._step: int | None = None
        self._latency = dict.fromkeys(_PHASES, 0.0)
        self._measured: set[str] = set()
        self._bwd_flops = 0

    @property
    def finished(self) -> bool:
        """True once the profile was printed (or abandoned), or when this rank never profiles."""
        return self._state is _State.DONE

    @contextlib.contextmanager
    def phase(self, name: Phase, *, step: int, partial: bool = False):
        """Time (and, up to the end of backward, count) one phase of the profiled step.

        Args:
            name: ``"forward"``, ``"backward"`` or ``"step"``.
            step: the engine's ``global_steps`` at the start of the phase.
            partial: this is a part of the phase and more follows (a pipeline's split
                backward: the input half, then the weight half); it is timed and counted,
                and the phase ends with its next part that is not partial.

        Raises:
            ValueError: an unknown phase name.
        """
        if name not in _PHASES:
            raise ValueError(f"phase must be one of {_PHASES}, got {name!r}")
        if self._state is _State.WAITING and name == "forward" and step == self.config.profile_step:
            self._step, self._state = step, _State.RUNNING
            self.profiler.start_profile()
        if self._state is not _State.RUNNING or step != self._step or name in self._measured:
            yield
            return
        sync = get_accelerator().synchronize
        sync()
        start, flops = time.perf_counter(), self.profiler.counted_flops()
        try:
            yield
        except BaseException:
            self._state = _State.DONE
            self.profiler.end_profile()
            raise
        sync()
        self._latency[name] += time.perf_counter() - start
        if name == "backward":
            self._bwd_flops += self.profiler.counted_flops() - flops
        if partial:
            return
        self._measured.add(name)
        if name == "forward":
            self.profiler.remove_hooks()  # later forwards of the step are not this micro-batch's
        elif name == "backward":
            self.profiler.stop_profile()
        elif name == "step":
            self._finish()

    def _finish(self) -> None:
        cfg, prof = self.config, self.profiler
        prof.step_timing = StepTiming(
            fwd_latency=self._latency["forward"],
            bwd_latency=self._latency["backward"],
            step_latency=self._latency["step"],
            bwd_flops=self._bwd_flops,
        )
        self._state = _State.DONE
        try:
            prof.print_model_profile(
                profile_step=self._step,
                module_depth=cfg.module_depth,
                top_modules=cfg.top_modules,
                detailed=cfg.detailed,
                output_file=cfg.output_file,
            )
        finally:
            prof.stop_profile()
