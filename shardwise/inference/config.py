"""DeepSpeed's import path ``deepspeed.inference.config``."""

from typing import Any

from shardwise.config._inference import InferenceConfig, inference_config


def DeepSpeedInferenceConfig(**kwargs: Any) -> InferenceConfig:  # noqa: N802 (DeepSpeed's class name)
    """DeepSpeed's config object, built from its keywords (``tensor_parallel={"tp_size": 2}``,
    ``kernel_inject=True``...); ``init_inference(model, config=...)`` takes it."""
    return inference_config(kwargs)


__all__ = ["DeepSpeedInferenceConfig"]
