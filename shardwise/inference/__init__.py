"""Inference: ``init_inference`` shards a model over the tensor group, loads checkpoints
slice by slice, stores weights as int8 on request and generates on a fast path (static KV
cache, fused projections, SDPA). See [Note: inference setup order] in ``engine.py``."""

from shardwise.config._inference import InferenceConfig
from shardwise.inference._generate import GenerationStats
from shardwise.inference.config import DeepSpeedInferenceConfig
from shardwise.inference.engine import InferenceEngine, init_inference

__all__ = ["DeepSpeedInferenceConfig", "GenerationStats", "InferenceConfig", "InferenceEngine", "init_inference"]
