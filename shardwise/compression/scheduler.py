"""``deepspeed.compression.scheduler``: moves a compressed model's layers along the training
steps (see [Note: compression schedule] in ``_layers.py``), and the engine's training
feature that drives it (see [Note: training features])."""

from __future__ import annotations

from torch import nn

from shardwise.compression._conv import CompressedConv2d
from shardwise.compression._layers import CompressedLinear
from shardwise.compression._snip_momentum import SnipMomentumPruner
from shardwise.config._errors import ConfigError


class CompressionScheduler:
    """Sets every :class:`CompressedLinear` and :class:`CompressedConv2d` of ``model`` to the
    training step.

    Raises:
        ConfigError: the model has no compressed layer (``init_compression`` was not called).
    """

    def __init__(self, model: nn.Module, compression_config=None):
        del compression_config  # each layer holds its own techniques and offsets
        self.layers = [m for m in model.modules() if isinstance(m, (CompressedLinear, CompressedConv2d))]
        if not self.layers:
            raise ConfigError(
                "compression_training enables a technique but the model has no compressed layer: call "
                "shardwise.compression.compress.init_compression(model, config) before initialize()"
            )
        snip = [m for m in self.layers if getattr(m.sparse_pruning, "method", None) == "snip_momentum"]
        self.pruner = SnipMomentumPruner(snip, snip[0].sparse_pruning.schedule) if snip else None
        self.training_steps = 0
        self.set_step(0)

    def set_step(self, training_steps: int) -> None:
        """Make the next forwards those of training step ``training_steps``."""
        self.training_steps = training_steps
        for layer in self.layers:
            layer.set_step(training_steps)

    def advance(self, training_steps: int, clip_coef: float | None = 1.0) -> None:
        """After an optimizer step: fold its gradients, scaled by ``clip_coef`` (the factor
        gradient clipping multiplied them by), into the snip_momentum scores, then move to
        ``training_steps``, recomputing the snip_momentum masks at its pruning steps (see
        [Note: snip_momentum schedule]); ``clip_coef`` None: a step the optimizer skipped,
        whose gradients the scores do not take."""
        if self.pruner is not None:
            self.pruner.accumulate(training_steps, clip_coef)
            self.pruner.prune_for(training_steps)
        self.set_step(training_steps)

    def step(self, step_zero_check: bool = False) -> None:
        """DeepSpeed's call after an optimizer step (``step_zero_check``: re-apply step 0)."""
        if step_zero_check:
            self.set_step(self.training_steps)
        else:
            self.advance(self.training_steps + 1)


def has_scheduled_layers(model: nn.Module) -> bool:
    """Whether ``model`` has compressed layers with a technique that moves with the step
    (weight quantization or pruning not yet folded in by ``redundancy_clean``)."""
    return any(
        m.weight_quantization or m.sparse_pruning or m.row_pruning or m.head_pruning
        for m in model.modules()
        if isinstance(m, CompressedLinear)
    ) or any(
        m.weight_quantization or m.sparse_pruning or m.channel_pruning
        for m in model.modules()
        if isinstance(m, CompressedConv2d)
    )


compression_scheduler = CompressionScheduler
"""DeepSpeed's class name."""


class CompressionFeature:
    """``compression_training`` as a training feature: before optimizer step ``k`` the
    snip_momentum pruner takes the gradients and the weights they apply to; after it the
    scores take them, scaled by the clipping coefficient, and the layers move to step
    ``k + 1``; the step count is saved with the engine state."""

    name = "compression_training"
    keyword_help: dict = {}

    def __init__(self, model: nn.Module):
        self.scheduler = CompressionScheduler(model)

    def forward_kwargs(self, global_steps: int) -> dict:
        del global_steps  # the layers read their step; the forward takes no keyword
        return {}

    def before_model_step(self, global_steps: int) -> None:
        if self.scheduler.pruner is not None:
            self.scheduler.pruner.collect(global_steps + 1)

    def after_optimizer_step(self, global_steps: int, clip_coef: float | None) -> None:
        self.scheduler.advance(global_steps + 1, clip_coef)

    def state_dict(self) -> dict:
        return {"training_steps": self.scheduler.training_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.set_step(state["training_steps"])
