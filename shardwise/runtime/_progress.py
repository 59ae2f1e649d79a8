"""Progress lines every ``steps_per_print`` steps and the wall-clock breakdown timers."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict

import torch

from shardwise.accelerator import get_accelerator

logger = logging.getLogger("shardwise")


class ProgressReporter:
    """Accumulates loss and timings between progress lines; rank 0 prints them.

    The loss reported is rank 0's mean over the micro-steps since the last line (no
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
        self._loss_sum = torch.zeros((), dtype=torch.float64)
        self._loss_count = 0
        self._timings: dict[str, float] = defaultdict(float)
        self._last_time = time.perf_counter()
        self._last_samples = 0
        self._last_steps = 0
        self._last_bytes: dict[str, int] = {}
        self.last: dict[str, float] = {}
        """The figures of the most recent progress line."""

    def timer(self, name: str):
        if not self.breakdown:
            return contextlib.nullcontext()
        return self._timed(name)

    @contextlib.contextmanager
    def _timed(self, name: str):
        accelerator = get_accelerator()
        accelerator.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            accelerator.synchronize()
            self._timings[name] += time.perf_counter() - start

    def record_loss(self, loss: torch.Tensor) -> None:
        # summed where the loss is: reading a GPU loss back here would make the Python
        # thread wait for backward to finish on every micro-step; it is read at print time
        if self._loss_sum.device != loss.device:  # made there (a copy would wait for the GPU)
            self._loss_sum = self._loss_sum.to(loss.device) if self._loss_count else \
                torch.zeros((), dtype=torch.float64, device=loss.device)
        self._loss_sum += loss.detach().to(torch.float64)
        self._loss_count += 1

    def after_model_step(self) -> None:
        """Called after each boundary step; prints every ``steps_per_print`` steps."""
        engine = self.engine
        if not self.every or engine.global_steps % self.every != 0:
            return
        now = time.perf_counter()
        elapsed = max(now - self._last_time, 1e-9)
        samples = engine.global_samples - self._last_samples
        loss = float(self._loss_sum) / max(self._loss_count, 1)
        lr = engine.get_lr()
        steps = max(engine.global_steps - self._last_steps, 1)
        sent = {op: (total - self._last_bytes.get(op, 0)) / steps for op, total in engine.comm.bytes.items()}
        sent = {op: n for op, n in sent.items() if n}
        self.last = {"step": engine.global_steps, "loss": loss, "lr": lr[0] if lr else 0.0,
                     "loss_scale": engine.get_loss_scale(), "samples_per_s": samples / elapsed,
                     "data_parallel_bytes_per_step": sent}
        if self.enabled:
            parts = [f"step {engine.global_steps}", f"loss {loss:.4f}",
                     f"lr {self.last['lr']:.3e}", f"{self.last['samples_per_s']:.1f} samples/s"]
            if engine.loss_scaler is not None:
                parts.insert(3, f"loss scale {engine.get_loss_scale():g}")
            if engine.skipped_steps:
                parts.append(f"skipped {engine.skipped_steps}")
            if sent:
                ops = ", ".join(f"{op} {_bytes(n)}" for op, n in sorted(sent.items()))
                parts.append(f"data-parallel payload {_bytes(sum(sent.values()))}/step ({ops})")
            if self.breakdown:
                steps = max(self._loss_count, 1)
                parts.append(" ".join(f"{k} {1000 * v / steps:.1f}ms" for k, v in self._timings.items()))
            logger.info(" | ".join(parts))
        self._loss_sum.zero_()
        self._loss_count = 0
        self._timings.clear()
        self._last_time, self._last_samples = now, engine.global_samples
        self._last_steps, self._last_bytes = engine.global_steps, dict(engine.comm.bytes)


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
