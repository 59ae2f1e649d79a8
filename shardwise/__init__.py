"""shardwise: fast, memory-efficient large-model training on PyTorch.

Accepts DeepSpeed's config schema and API: ``import shardwise as deepspeed`` runs a
DeepSpeed training script unchanged (and ``shardwise.install_as_deepspeed()`` lets
libraries that import ``deepspeed`` themselves, like Hugging Face's, use shardwise).
"""

from shardwise import _logging, checkpointing, comm, inference, moe, monitor, ops, profiling, utils, zero
from shardwise._as_deepspeed import install_as_deepspeed
from shardwise._initialize import add_config_arguments, initialize, tp_model_init
from shardwise.comm import init_distributed
from shardwise.inference import InferenceEngine, init_inference
from shardwise.runtime.config import DeepSpeedConfig
from shardwise.runtime.engine import DeepSpeedEngine, Engine
from shardwise.version import __version__

__all__ = ["DeepSpeedConfig", "DeepSpeedEngine", "Engine", "InferenceEngine", "__version__", "add_config_arguments",
           "checkpointing", "comm", "inference", "init_distributed", "init_inference", "initialize",
           "install_as_deepspeed", "moe", "monitor", "ops", "profiling", "tp_model_init", "utils", "zero"]

_logging.install_default_handler()
