"""shardwise: fast, memory-efficient large-model training on PyTorch.

Accepts DeepSpeed's config schema and API: ``import shardwise as deepspeed`` runs a
DeepSpeed training script unchanged (and ``shardwise.install_as_deepspeed()`` lets
libraries that import ``deepspeed`` themselves, like Hugging Face's, use shardwise).
"""

import importlib as _importlib

from shardwise import (
    _logging,
    checkpointing,
    comm,
    inference,
    module_inject,
    moe,
    monitor,
    ops,
    pipe,
    profiling,
    utils,
    zero,
)
from shardwise._as_deepspeed import install_as_deepspeed
from shardwise._initialize import add_config_arguments, initialize, tp_model_init
from shardwise.accelerator import get_accelerator
from shardwise.comm import init_distributed
from shardwise.inference import InferenceEngine, init_inference
from shardwise.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer
from shardwise.pipe import PipelineModule
from shardwise.pipe.engine import PipelineEngine
from shardwise.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from shardwise.runtime.engine import DeepSpeedEngine, Engine
from shardwise.runtime.hybrid_engine import DeepSpeedHybridEngine, HybridEngine
from shardwise.utils import OnDevice, log_dist, logger
from shardwise.version import __version__

__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "DeepSpeedHybridEngine",
    "DeepSpeedTransformerConfig",
    "DeepSpeedTransformerLayer",
    "Engine",
    "HybridEngine",
    "InferenceEngine",
    "OnDevice",
    "PipelineEngine",
    "PipelineModule",
    "__version__",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "get_accelerator",
    "inference",
    "init_distributed",
    "init_inference",
    "initialize",
    "install_as_deepspeed",
    "log_dist",
    "logger",
    "module_inject",
    "moe",
    "monitor",
    "ops",
    "pipe",
    "profiling",
    "tp_model_init",
    "utils",
    "zero",
]

_DEEPSPEED_SUBMODULES = (
    "autotuning",
    "checkpoint.utils",
    "profiling.flops_profiler.profiler",
    "runtime.data_pipeline.data_routing",
    "runtime.data_pipeline.data_sampling",
    "runtime.dataloader",
    "runtime.fp16",
    "runtime.pipe.engine",
    "runtime.pipe.module",
    "runtime.pipe.topology",
    "runtime.utils",
)
"""Submodules that DeepSpeed's own ``import deepspeed`` leaves reachable as attributes
(``deepspeed.runtime.utils.set_random_seed`` after a bare import) and that nothing above
imports; importing them here costs milliseconds."""
for _name in _DEEPSPEED_SUBMODULES:
    _importlib.import_module(f"{__name__}.{_name}")
del _name

_logging.install_default_handler()
