"""DeepSpeed's data-efficiency library (``deepspeed.runtime.data_pipeline``): curriculum
schedules, and the helpers by which a model follows the legacy sequence-length curriculum
(``curriculum_seqlen``) and progressive layer drop (``pld_theta``) the engine passes to
its training forward."""

from shardwise.runtime.data_pipeline._helpers import (
    CurriculumTruncation,
    drop_layer,
    layer_keep_probability,
    truncate_to_curriculum,
)
from shardwise.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

__all__ = [
    "CurriculumScheduler",
    "CurriculumTruncation",
    "drop_layer",
    "layer_keep_probability",
    "truncate_to_curriculum",
]
