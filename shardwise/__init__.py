"""shardwise: fast, memory-efficient large-model training on PyTorch.

Accepts DeepSpeed's config schema and API: ``import shardwise as deepspeed`` runs a
DeepSpeed training script unchanged (and ``shardwise.install_as_deepspeed()`` lets
libraries that import ``deepspeed`` themselves, like Hugging Face's, use shardwise).

[Note: lazy package import]
``import shardwise`` itself imports almost nothing: the first attribute read on the package
(``shardwise.initialize``, ``from shardwise import zero``, ``shardwise.runtime.utils``...)
imports everything below at once, exactly what an eager ``__init__`` would import, so every
name DeepSpeed's ``import deepspeed`` offers is there from that read on. Processes that only
need a submodule do not pay for the rest: ``shardwise run`` (the launcher, which starts
its ranks and waits) starts in a fraction of the time, and so does ``shardwise --help``.
Importing a submodule directly (``import shardwise.zero``) imports that submodule and
what it needs, as for any package.
"""

import importlib as _importlib
import threading as _threading

from shardwise import _logging
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

_lock = _threading.RLock()
_loader: int | None = None
"""The thread running ``_load`` (its own reads of missing names fall back to the import
system, as in an eager ``__init__`` that is still running)."""
_loaded = False


def _load() -> None:
    """Import the public API and the submodules DeepSpeed's import leaves reachable (see
    [Note: lazy package import]); their names land in this module's namespace."""
    global _loader, _loaded
    _loader = _threading.get_ident()
    try:
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

        names = dict(locals())
        for name in _DEEPSPEED_SUBMODULES:
            _importlib.import_module(f"{__name__}.{name}")
    finally:
        _loader = None
    globals().update({name: value for name, value in names.items() if not name.startswith("_")})
    _loaded = True


def __getattr__(name: str):
    if not name.startswith("__") and _loader != _threading.get_ident():
        with _lock:
            if not _loaded:
                _load()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    with _lock:
        if not _loaded:
            _load()
    return sorted(globals())


_logging.install_default_handler()
