"""DeepSpeed's ``ProgressiveLayerDrop``: the keep probability ``theta(t)`` of progressive
layer dropping (Zhang and He, 2020, https://arxiv.org/abs/2010.13369) as a function of
the optimizer step. The engine updates it at every optimizer step (before the step count
moves) and passes it to the model's training forward as ``pld_theta``; the model skips
its blocks with it (``shardwise.runtime.data_pipeline.drop_layer``)."""

from __future__ import annotations

import math


class ProgressiveLayerDrop:
    """``theta(t) = (1 - theta) * exp(-gamma * t) + theta``: 1.0 before the first update,
    then decaying towards ``theta``.

    Args:
        theta: the keep probability the schedule decays to (the lower, the more layers
            are dropped late in training). Default 0.5, as DeepSpeed's class (its config
            section defaults to 1.0).
        gamma: how fast it decays. Default 0.001.
    """

    def __init__(self, theta: float = 0.5, gamma: float = 0.001):
        self.theta = theta
        self.gamma = gamma
        self.current_theta = 1.0
        """The keep probability now."""

    def get_state(self) -> dict:
        """The keywords the engine passes to the forward:
        ``{"progressive_layer_drop": True, "pld_theta": <current theta>}``."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        """Set the keep probability to the schedule's value at ``global_step``."""
        self.current_theta = (1.0 - self.theta) * math.exp(-self.gamma * global_step) + self.theta
