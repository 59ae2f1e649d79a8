"""DeepSpeed's import path ``deepspeed.inference.config``."""

import dataclasses
from typing import Any

from shardwise.config._inference import InferenceConfig, inference_config


class DeepSpeedInferenceConfig(InferenceConfig):
    """DeepSpeed's config class, built from its keywords (``tensor_parallel={"tp_size": 2}``,
    ``kernel_inject=True``...) with the same checks as ``init_inference``'s; an
    :class:`~shardwise.inference.InferenceConfig` whose fields are shardwise's (``tp_size``
    rather than ``tensor_parallel.tp_size``). ``init_inference(model, config=...)`` takes it."""

    def __init__(self, **kwargs: Any) -> None:
        built = inference_config(kwargs)
        for field in dataclasses.fields(InferenceConfig):
            object.__setattr__(self, field.name, getattr(built, field.name))


__all__ = ["DeepSpeedInferenceConfig"]
