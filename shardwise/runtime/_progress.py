"""Progress lines every ``steps_per_print`` steps, the wall-clock breakdown timers, and the
events the engine writes to its monitors after every optimizer step.

[Note: monitor events]
After each optimizer step global rank 0 writes, at x = ``engine.global_samples``:
``Train/Samples/train_loss`` (the mean of the losses passed to ``backward`` in that step;
the pipeline engine's batch loss), ``Train/Samples/lr`` (first parameter group) and, with
fp16, ``Train/Samples/loss_scale``; with ``wall_clock_breakdown``
``Train/Samples/elapsed_time_ms_{forward,backward,backward_inner,backward_allreduce,step}``
(milliseconds spent in that optimizer step, summed over its micro-steps; the pipeline
engine adds its transfers, ``..._pipe_{send_output,recv_input,send_grad,recv_grad}``, and the
ZeRO strategy its waits, ``..._gather_params`` (stage 3, inside forward and backward) and
``..._optimizer_swap_{in,out}_state`` (optimizer offload, inside step)); with
``memory_breakdown`` ``Train/Samples/memory_{allocated,max_allocated,host_rss,model_states}_MB``.
The loss is read back from the device once per optimizer step, and only while a monitor is
enabled; the timers synchronise the device only while ``wall_clock_breakdown`` is on.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
from collections import defaultdict

import torch

from shardwise._host_memory import host_memory
from shardwise.accelerator import get_accelerator

logger = logging.getLogger("shardwise")

TAG = "Train/Samples/"
TIMERS = ("forward", "backward", "backward_inner", "backward_allreduce", "step")
"""DeepSpeed's engine timers, in its order."""


class _LossSum:
    """A running sum of losses kept where the losses are (reading a GPU loss back on every
    micro-step would make the Python thread wait for backward)."""

    def __init__(self):
        self.total = torch.zeros((), dtype=torch.float64)
        self.count = 0

    def add(self, loss: torch.Tensor) -> None:
        if self.total.device != loss.device:
            self.total = (
                self.total.to(loss.device) if self.count else torch.zeros((), dtype=torch.float64, device=loss.device)
            )
        self.total += loss.detach().to(torch.float64)
        self.count += 1

    def mean_and_reset(self) -> float:
        mean = float(self.total) / max(self.count, 1)
        self.total.zero_()
        self.count = 0
        return mean


class ProgressReporter:
    """Accumulates loss and timings between progress lines; rank 0 prints them and writes
    the monitor events of every optimizer step (see [Note: monitor events]).

    The loss printed is rank 0's mean over the micro-steps since the last line (no
    collective is spent on logging); the data-parallel payload is what rank 0's
    data-parallel communicator sent per optimizer step since then, by collective
    (``engine.comm.bytes`` holds the running totals), e.g. to see what the 1-bit
    optimizers save.
    """

    def __init__(self, engine, *, enabled: bool):
        self.engine = engine
        self.enabled = enabled
        self.every = engine.train_config.steps_per_print
        self.breakdown = engine.train_config.wall_clock_breakdown
        self.memory = engine.train_config.monitor.memory_breakdown
        self._window_loss = _LossSum()
        self._step_loss = _LossSum()
        self._timings: dict[str, float] = defaultdict(float)
        self._step_timings: dict[str, float] = defaultdict(float)
        self._last_time = time.perf_counter()
        self._last_samples = 0
        self._last_steps = 0
        self._last_bytes: dict[str, int] = {}
        self.last: dict[str, float] = {}
        """The figures of the most recent progress line."""
        self._flops = self._step_profiler(engine) if enabled else None

    def _step_profiler(self, engine):
        """The FLOPs profiler of the ``flops_profiler`` step (rank 0), or None when off."""
        config = engine.train_config.monitor.flops_profiler
        if not config.enabled:
            return None
        from shardwise.profiling.flops_profiler import StepProfiler

        profiler = StepProfiler(engine.module, config, engine=engine)

        def never_reached():
            if not profiler.finished:
                logger.warning(
                    "flops_profiler.profile_step=%d was never reached: the run ended after %d "
                    "optimizer steps; choose a smaller profile_step",
                    config.profile_step,
                    engine.global_steps,
                )

        atexit.register(never_reached)
        return profiler

    def timer(self, name: str, *, partial: bool = False):
        """Time ``name`` (with ``wall_clock_breakdown``) and, in the ``flops_profiler`` step,
        profile it (``partial``: a part of that phase, more follows; see
        ``StepProfiler.phase``); a no-op context otherwise."""
        if self._flops is not None and name in ("forward", "backward", "step"):
            return self._profiled(name, partial)
        if not self.breakdown:
            return contextlib.nullcontext()
        return self._timed(name)

    @contextlib.contextmanager
    def _profiled(self, name: str, partial: bool):
        with (
            self._flops.phase(name, step=self.engine.global_steps, partial=partial),
            self._timed(name) if self.breakdown else contextlib.nullcontext(),
        ):
            yield
        if self._flops.finished:
            self._flops = None  # printed; its hooks are gone and so is its cost

    @contextlib.contextmanager
    def _timed(self, name: str):
        accelerator = get_accelerator()
        accelerator.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            accelerator.synchronize()
            elapsed = time.perf_counter() - start
            self._timings[name] += elapsed
            self._step_timings[name] += elapsed

    def record_loss(self, loss: torch.Tensor) -> None:
        self._window_loss.add(loss)
        if self._monitoring:
            self._step_loss.add(loss)

    @property
    def _monitoring(self) -> bool:
        return self.enabled and self.engine.monitor.enabled

    def after_model_step(self) -> None:
        """Called after each boundary step: writes its monitor events; prints every
        ``steps_per_print`` steps."""
        self._write_events()
        engine = self.engine
        if not self.every or engine.global_steps % self.every != 0:
            return
        now = time.perf_counter()
        elapsed = max(now - self._last_time, 1e-9)
        samples = engine.global_samples - self._last_samples
        micro_steps = max(self._window_loss.count, 1)
        loss = self._window_loss.mean_and_reset()
        lr = engine.get_lr()
        steps = max(engine.global_steps - self._last_steps, 1)
        sent = {op: (total - self._last_bytes.get(op, 0)) / steps for op, total in engine.comm.bytes.items()}
        sent = {op: n for op, n in sent.items() if n}
        self.last = {
            "step": engine.global_steps,
            "loss": loss,
            "lr": lr[0] if lr else 0.0,
            "loss_scale": engine.get_loss_scale(),
            "samples_per_s": samples / elapsed,
            "data_parallel_bytes_per_step": sent,
        }
        if self.enabled:
            parts = [
                f"step {engine.global_steps}",
                f"loss {loss:.4f}",
                f"lr {self.last['lr']:.3e}",
                f"{self.last['samples_per_s']:.1f} samples/s",
            ]
            if engine.loss_scaler is not None:
                parts.insert(3, f"loss scale {engine.get_loss_scale():g}")
            if engine.skipped_steps:
                parts.append(f"skipped {engine.skipped_steps}")
            if sent:
                ops = ", ".join(f"{op} {_bytes(n)}" for op, n in sorted(sent.items()))
                parts.append(f"data-parallel payload {_bytes(sum(sent.values()))}/step ({ops})")
            if self.breakdown:
                parts.append(" ".join(f"{k} {1000 * v / micro_steps:.1f}ms" for k, v in self._timings.items()))
            if self.memory:
                parts.append("memory " + ", ".join(f"{k} {v:.0f} MB" for k, v in self._memory().items()))
            logger.info(" | ".join(parts))
        self._timings.clear()
        self._last_time, self._last_samples = now, engine.global_samples
        self._last_steps, self._last_bytes = engine.global_steps, dict(engine.comm.bytes)

    def _write_events(self) -> None:
        step_timings, self._step_timings = self._step_timings, defaultdict(float)
        if not self._monitoring:
            return
        engine = self.engine
        samples = engine.global_samples
        events = [(TAG + "train_loss", self._step_loss.mean_and_reset(), samples)]
        lr = engine.get_lr()
        if lr:
            events.append((TAG + "lr", lr[0], samples))
        if engine.loss_scaler is not None:
            events.append((TAG + "loss_scale", engine.get_loss_scale(), samples))
        if self.breakdown:
            names = list(TIMERS) + [name for name in step_timings if name not in TIMERS]
            events += [(f"{TAG}elapsed_time_ms_{name}", 1000 * step_timings.get(name, 0.0), samples) for name in names]
        if self.memory:
            events += [(f"{TAG}memory_{name}_MB", value, samples) for name, value in self._memory().items()]
        engine.monitor.write_events(events)

    def _memory(self) -> dict[str, float]:
        """Device memory allocated and its peak (CPU: the process RSS), host RSS and the
        model-state bytes the engine holds, in MB."""
        accelerator = get_accelerator()
        mb = 1 / 2**20
        return {
            "allocated": accelerator.memory_allocated() * mb,
            "max_allocated": accelerator.max_memory_allocated() * mb,
            "host_rss": host_memory.current() * mb,
            "model_states": self.engine.model_state_bytes().total * mb,
        }


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
