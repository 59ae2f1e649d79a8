"""DeepSpeed's import path ``deepspeed.inference.config``."""

from shardwise.config._inference import InferenceConfig

DeepSpeedInferenceConfig = InferenceConfig

__all__ = ["DeepSpeedInferenceConfig"]
