"""The engine's one extension point for features that act around the training step
without being part of it (the legacy curriculum, progressive layer drop, random-LTD, the
compression scheduler, the profiled window of an autotuning experiment).

[Note: training features]
A training feature is an object with a ``name`` (its key in checkpoints), a
``keyword_help`` (for each keyword it passes, how a model that lacks it can take it) and
five methods: ``forward_kwargs(global_steps)`` (keywords for the training forward),
``before_model_step(global_steps)`` (called at each optimizer step, before the optimizer
runs and the step count moves), ``after_optimizer_step(global_steps, clip_coef)`` (called
after the optimizer ran, skipped steps included, before the step count moves;
``clip_coef`` is the factor gradient clipping multiplied the gradients by, 1.0 when it did
not, None when the optimizer skipped the step after an fp16 overflow), ``state_dict()``
and ``load_state_dict(state)`` (plain data, saved with the engine state).
:func:`build_training_features` makes them from the config; the engine calls
:class:`TrainingFeatures` at those four points and never knows which features there are.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from torch import nn

from shardwise.config._errors import ConfigError
from shardwise.runtime._autotuning_profile import autotuning_profile
from shardwise.runtime.data_pipeline._features import LayerDrop, SeqlenCurriculum

logger = logging.getLogger("shardwise")


class TrainingFeature(Protocol):
    """See [Note: training features]."""

    name: str
    keyword_help: Mapping[str, str]

    def forward_kwargs(self, global_steps: int) -> dict: ...

    def before_model_step(self, global_steps: int) -> None: ...

    def after_optimizer_step(self, global_steps: int, clip_coef: float | None) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _check_forward_accepts(module: nn.Module, kwargs: Mapping, helps: Mapping[str, str]) -> None:
    """Raise TypeError naming the first keyword of ``kwargs`` that ``module.forward`` cannot
    take, and how to take it (a forward with ``**kwargs`` takes everything)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a C extension): let the call decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for keyword in kwargs:
        if keyword not in names:
            raise TypeError(
                f"{type(module).__name__}.forward does not accept the keyword '{keyword}', which the "
                f"engine passes to every training forward for this config; {helps[keyword]}"
            )


class TrainingFeatures:
    """The config's training features, in a fixed order (see [Note: training features])."""

    def __init__(self, features: Sequence[TrainingFeature] = ()):
        self._features = tuple(features)
        self._checked = False

    def add(self, feature: TrainingFeature) -> None:
        """Add ``feature`` after those of the config (the curriculum sampler of a loader
        ``deepspeed_io`` built); one of the same name is replaced."""
        self._features = tuple(f for f in self._features if f.name != feature.name) + (feature,)

    def find(self, name: str) -> TrainingFeature | None:
        """The feature called ``name``; None when the config does not enable it."""
        return next((f for f in self._features if f.name == name), None)

    def forward_kwargs(self, module: nn.Module, global_steps: int) -> dict:
        """The keywords for a forward of ``module`` (none in eval mode, as DeepSpeed). The
        first call checks that ``module.forward`` takes them."""
        if not self._features or not module.training:
            return {}
        kwargs: dict = {}
        helps: dict = {}
        for feature in self._features:
            kwargs.update(feature.forward_kwargs(global_steps))
            helps.update(feature.keyword_help)
        if not self._checked:
            _check_forward_accepts(module, kwargs, helps)
            self._checked = True
        return kwargs

    def before_model_step(self, global_steps: int) -> None:
        for feature in self._features:
            feature.before_model_step(global_steps)

    def after_optimizer_step(self, global_steps: int, clip_coef: float | None) -> None:
        for feature in self._features:
            feature.after_optimizer_step(global_steps, clip_coef)

    def state_dict(self) -> dict:
        return {feature.name: feature.state_dict() for feature in self._features}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore each feature the checkpoint has; one it lacks starts afresh (logged)."""
        for feature in self._features:
            if feature.name in state:
                feature.load_state_dict(state[feature.name])
            else:
                logger.warning("the checkpoint has no %s state; it starts from the beginning", feature.name)


def _compression_feature(config, model: nn.Module) -> TrainingFeature:
    """The compression scheduler; ZeRO-3 is refused (its layers see partitioned weights), and
    snip_momentum with pipeline stages or tensor parallelism (its scores average the
    gradients over every rank, each taken as a data-parallel replica)."""
    from shardwise.compression.scheduler import CompressionFeature
    from shardwise.pipe.module import PipelineModule  # the pipeline package imports the engine

    if config.zero.stage == 3:
        raise ConfigError(
            "compression_training (quantization-aware training, pruning) is not available with ZeRO "
            "stage 3: the compressed layers quantize and mask whole weights, which stage 3 partitions; "
            "use zero_optimization.stage 0, 1 or 2"
        )
    feature = CompressionFeature(model)
    tensor_parallel = (config.raw.get("tensor_parallel") or {}).get("autotp_size") or 1
    if feature.scheduler.pruner is not None and (isinstance(model, PipelineModule) or tensor_parallel > 1):
        split = (
            "pipeline stages" if isinstance(model, PipelineModule) else f"tensor_parallel.autotp_size {tensor_parallel}"
        )
        raise ConfigError(
            f"sparse_pruning's snip_momentum is not available with {split} in this version of shardwise: its "
            "scores average each weight's gradient over every rank as data-parallel replicas; use method "
            "'l1' or 'topk', or train without the split"
        )
    return feature


def _refuse_unscheduled_compression(model: nn.Module) -> None:
    """A model prepared by ``init_compression`` needs the section that schedules it: without
    it the layers would stay at step 0 (DeepSpeed's would silently not compress)."""
    from shardwise.compression.scheduler import has_scheduled_layers

    if has_scheduled_layers(model):
        raise ConfigError(
            "the model has compressed layers (shardwise.compression.compress.init_compression) but the "
            "config given to initialize() enables no compression_training technique to schedule them; "
            "pass the config given to init_compression, or call redundancy_clean first"
        )


def build_training_features(config, model: nn.Module) -> TrainingFeatures:
    """The training features ``config`` (a ``TrainConfig``) enables, for ``model``.

    Raises:
        ConfigError: a feature that passes keywords to the forward, with a PipelineModule
            (its stages take one input each; DeepSpeed's pipeline engine skipped them too).
    """
    from shardwise.pipe.module import PipelineModule  # the pipeline package imports the engine

    features: list[TrainingFeature] = []
    if config.curriculum_learning.enabled:
        features.append(SeqlenCurriculum(config.curriculum_learning))
    if config.progressive_layer_drop.enabled:
        features.append(LayerDrop(config.progressive_layer_drop))
    random_ltd = config.data_efficiency.data_routing.random_ltd
    if random_ltd.get("enabled", False):
        from shardwise.runtime.data_pipeline.data_routing import RandomLTD

        features.append(RandomLTD.from_config(random_ltd, model, global_batch_size=config.batch.train_batch_size))
    # keywords a PipelineModule's stages do not take; random-LTD's layers move with the
    # engine's forward, which the pipeline engine does not run
    refused = [f for f in features if f.keyword_help or f.name == "random_ltd"]
    if refused and isinstance(model, PipelineModule):
        names = " and ".join(f"'{f.name}'" for f in refused)
        raise ConfigError(
            f"{names} act on the model's forward (keywords a PipelineModule's stages do not take, layers "
            "converted for random-LTD; DeepSpeed's pipeline engine ran neither); not available with pipeline "
            "parallelism: set enabled to false, and for a sequence-length curriculum cut the batches in "
            "the data iterator (shardwise.runtime.data_pipeline.CurriculumScheduler and truncate_to_curriculum)"
        )
    if config.compression_training.enabled:
        features.append(_compression_feature(config, model))
    else:
        _refuse_unscheduled_compression(model)
    profile = autotuning_profile(config, model)  # passes no keyword: fine with a pipeline
    if profile is not None:
        features.append(profile)
    return TrainingFeatures(features)
