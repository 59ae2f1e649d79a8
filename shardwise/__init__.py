"""shardwise: fast, memory-efficient large-model training on PyTorch.

Accepts DeepSpeed's config schema and API: ``import shardwise as deepspeed`` runs a
DeepSpeed training script unchanged.
"""

from shardwise import _logging, ops, zero
from shardwise._initialize import add_config_arguments, initialize
from shardwise.comm import init_distributed
from shardwise.runtime.engine import Engine

__version__ = "0.1.0"

DeepSpeedEngine = Engine
"""Alias for scripts that type-check against DeepSpeed's engine class name."""

__all__ = ["DeepSpeedEngine", "Engine", "__version__", "add_config_arguments", "init_distributed", "ops", "zero",
           "initialize"]

_logging.install_default_handler()
