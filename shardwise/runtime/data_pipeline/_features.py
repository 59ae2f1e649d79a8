"""The training features of the legacy data-efficiency sections, as the engine's
``TrainingFeatures`` holds them (see ``runtime/_training_features.py``): each passes
keywords to the model's training forward, may move at each optimizer step, and has a
checkpointed state."""

from __future__ import annotations

import copy

from shardwise.config._data_efficiency import LegacyCurriculumConfig, ProgressiveLayerDropConfig
from shardwise.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from shardwise.runtime.progressive_layer_drop import ProgressiveLayerDrop


class SeqlenCurriculum:
    """``curriculum_learning`` (legacy): before each training forward the scheduler moves
    to ``global_steps + 1`` (the step the forward's gradients will make) and the forward
    gets ``curriculum_seqlen=<difficulty>``."""

    name = "curriculum_learning"
    keyword_help = {
        "curriculum_seqlen": (
            "accept it and cut the batch with shardwise.runtime.data_pipeline.truncate_to_curriculum("
            "batch, curriculum_seqlen), or wrap the model before initialize(): "
            "shardwise.runtime.data_pipeline.CurriculumTruncation(model)"
        )
    }

    def __init__(self, config: LegacyCurriculumConfig):
        self.scheduler = CurriculumScheduler(config.scheduler_config())
        """DeepSpeed's ``engine.curriculum_scheduler_legacy``."""

    def forward_kwargs(self, global_steps: int) -> dict:
        return {"curriculum_seqlen": self.scheduler.update_difficulty(global_steps + 1)}

    def before_model_step(self, global_steps: int) -> None:
        del global_steps  # the schedule moves at the forward

    def after_optimizer_step(self, global_steps: int, clip_coef: float | None) -> None:
        del global_steps, clip_coef  # nothing moves after the optimizer step

    def state_dict(self) -> dict:
        return copy.deepcopy(self.scheduler.get_state())

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.set_state(state)


class LayerDrop:
    """``progressive_layer_drop``: every training forward gets ``progressive_layer_drop=True,
    pld_theta=<keep probability>``; theta moves at each optimizer step, from the step count
    before the step (as DeepSpeed's engine: the first forward sees 1.0, the forward after
    optimizer step ``k`` sees ``theta(k - 1)``)."""

    name = "progressive_layer_drop"
    keyword_help = dict.fromkeys(
        ("progressive_layer_drop", "pld_theta"),
        "accept progressive_layer_drop and pld_theta and skip the blocks with "
        "shardwise.runtime.data_pipeline.drop_layer(block, hidden, ..., theta=pld_theta, ...)",
    )

    def __init__(self, config: ProgressiveLayerDropConfig):
        self.schedule = ProgressiveLayerDrop(theta=config.theta, gamma=config.gamma)
        """DeepSpeed's ``engine.progressive_layer_drop``."""

    def forward_kwargs(self, global_steps: int) -> dict:
        del global_steps  # theta moves at the optimizer step
        return self.schedule.get_state()

    def before_model_step(self, global_steps: int) -> None:
        self.schedule.update_state(global_steps)

    def after_optimizer_step(self, global_steps: int, clip_coef: float | None) -> None:
        del global_steps, clip_coef  # nothing moves after the optimizer step

    def state_dict(self) -> dict:
        return {"current_theta": self.schedule.current_theta}

    def load_state_dict(self, state: dict) -> None:
        self.schedule.current_theta = state["current_theta"]
