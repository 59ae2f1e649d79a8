"""Loss scaling for fp16 training.

fp16 gradients underflow unless the loss is multiplied by a large factor before backward
and the gradients divided by it afterwards. A dynamic scaler starts high, halves the scale
when a step overflows (after ``hysteresis`` overflows, with the step skipped each time)
and doubles it after ``loss_scale_window`` clean steps, never going below
``min_loss_scale``. A static scaler keeps one value.

Unlike DeepSpeed, an overflow at the minimum scale does not end the run: the step is
skipped, a warning with a diagnosis is logged, and training goes on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_WARN_AFTER_OVERFLOWS_AT_MIN = 5


@dataclass(kw_only=True)
class LossScaler:
    """Holds the current loss scale and updates it after every optimizer step.

    Args:
        scale: the current (initial) scale.
        dynamic: whether overflows and clean windows change the scale.
        window: clean steps before the scale doubles.
        hysteresis: overflows tolerated before the scale halves.
        consecutive_hysteresis: refill the hysteresis budget on every clean step
            instead of only when the scale grows.
        min_scale: the floor of the scale.
    """

    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        self._hysteresis_left = self.hysteresis
        self._iteration = 0
        self._last_overflow_iteration = -1
        self._overflows_at_min = 0

    @classmethod
    def from_config(cls, fp16) -> LossScaler:
        """Build the scaler an ``FP16Config`` describes (static when loss_scale > 0)."""
        if fp16.loss_scale > 0:
            return cls(scale=float(fp16.loss_scale), dynamic=False)
        return cls(
            scale=float(2**fp16.initial_scale_power),
            dynamic=True,
            window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_scale=float(fp16.min_loss_scale),
        )

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome and adjust the scale."""
        if self.dynamic:
            if overflow:
                self._on_overflow()
            else:
                self._on_clean_step()
        self._iteration += 1

    def _on_overflow(self) -> None:
        self._last_overflow_iteration = self._iteration
        if self.hysteresis > 1 and self._hysteresis_left > 1:
            self._hysteresis_left -= 1
            return
        if self.scale <= self.min_scale:
            self._overflows_at_min += 1
            if self._overflows_at_min % _WARN_AFTER_OVERFLOWS_AT_MIN == 0:
                logger.warning(
                    "fp16 gradients overflowed %d times at the minimum loss scale %g: the "
                    "loss or activations are too large for fp16 (inf/nan in the forward, "
                    "a too-high learning rate, or a diverging run). Steps are being skipped; "
                    "consider bf16, a lower lr, or gradient clipping.",
                    self._overflows_at_min,
                    self.min_scale,
                )
            return
        self.scale = max(self.scale / self.factor, self.min_scale)

    def _on_clean_step(self) -> None:
        self._overflows_at_min = 0
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        if (self._iteration - self._last_overflow_iteration) % self.window == 0:
            if not self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            self.scale *= self.factor

    def state_dict(self) -> dict:
        """Plain numbers that restore the scaler exactly."""
        return {
            "scale": self.scale,
            "dynamic": self.dynamic,
            "iteration": self._iteration,
            "last_overflow_iteration": self._last_overflow_iteration,
            "hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._iteration = int(state["iteration"])
        self._last_overflow_iteration = int(state["last_overflow_iteration"])
        self._hysteresis_left = int(state["hysteresis_left"])
