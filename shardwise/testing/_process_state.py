"""Put a pooled rank process back in the state a newly started one is in.

[Note: what a reused rank resets]
A rank process kept alive between ``run_distributed`` calls must look, to the next body,
like a process started for it. Before each call it therefore takes, from the caller, the
environment, ``sys.path`` and working directory (a rank forked from the pool's server
would otherwise have the server's), and puts back what it recorded when it started: torch's default dtype and device,
grad mode, anomaly detection, deterministic-algorithm mode, thread count and the CPU
generator's state (a fresh process always starts from torch's fixed default seed), with
``torch.compile``'s caches emptied; the state of ``random`` and numpy's global
generator; the warning filters and once-registries; the logging levels and handlers of
the root and ``shardwise`` loggers. Shardwise's own process-wide records are forgotten
(``forget_library_state``). After each call, every module attribute the call rebound in
shardwise, ``torch.distributed`` and the body's own module is put back (``ModuleGlobals``:
a body that sets ``_shm.CAPACITY_BYTES`` or replaces ``dist.all_reduce`` leaves no
trace), the process runs what its exit would have run for that call (swap directories are
removed) and collects garbage.

Anything else a body changes for the rest of its process (objects changed in place, class
attributes, ``sys.modules`` entries such as the ``deepspeed`` alias, atexit handlers,
third-party singletons) survives: a body that does that, or whose test checks what happens
at process exit or import, asks for ``fresh_processes=True``.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import sys
import warnings

import torch

_LOGGERS = ("", "shardwise")


class ProcessBaseline:
    """What a rank process looked like before its first call, and how to return to it."""

    def __init__(self) -> None:
        self.dtype = torch.get_default_dtype()
        self.deterministic = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        self.torch_rng = torch.get_rng_state()
        self.python_rng = random.getstate()
        self.numpy_rng = _numpy_state()
        self.warning_filters = list(warnings.filters)
        self.loggers = {name: _logger_state(logging.getLogger(name)) for name in _LOGGERS}

    def restore(self, *, environ: dict, sys_path: list, cwd: str) -> None:
        """Return to the recorded state and take the caller's environment, path and cwd."""
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = sys_path
        os.chdir(cwd)
        self._restore_torch()
        random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            sys.modules["numpy"].random.set_state(self.numpy_rng)
        warnings.resetwarnings()  # also invalidates every module's once-registry
        warnings.filters[:] = self.warning_filters
        warnings.onceregistry.clear()
        logging.disable(logging.NOTSET)
        for name, state in self.loggers.items():
            _set_logger_state(logging.getLogger(name), state)
        forget_library_state()

    def _restore_torch(self) -> None:
        torch.set_default_dtype(self.dtype)
        if torch.get_default_device().type != "cpu":
            torch.set_default_device(None)
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_num_threads(1)
        torch.set_rng_state(self.torch_rng)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()


class ModuleGlobals:
    """The attributes of the watched modules as a call found them (see the module docstring)."""

    def __init__(self, *also: str) -> None:
        names = [name for name in sys.modules if _watched(name)] + [name for name in also if name in sys.modules]
        self.saved = {name: dict(vars(sys.modules[name])) for name in names}

    def restore(self) -> None:
        """Rebind every attribute that now names another object; attributes added are kept
        (a package gains one per submodule imported)."""
        for name, saved in self.saved.items():
            module = sys.modules.get(name)
            if module is None:
                continue
            current = vars(module)
            for key, value in saved.items():
                if current.get(key, _MISSING) is not value:
                    setattr(module, key, value)


def _watched(name: str) -> bool:
    if name == "torch.distributed":
        return True
    return (name == "shardwise" or name.startswith("shardwise.")) and not name.startswith("shardwise.testing")


_MISSING = object()


def after_call() -> None:
    """What the end of a started rank's life did for one call: its swap directories are
    removed (``offload/_nvme.py`` does that at exit), and its garbage is collected."""
    nvme = sys.modules.get("shardwise.offload._nvme")
    if nvme is not None:
        nvme._cleanup()
    gc.collect()


def forget_library_state() -> None:
    """Forget shardwise's process-wide records, each as a new process starts without them.

    A module not imported yet has nothing to forget; each entry names the module that keeps
    the record.
    """
    modules = sys.modules
    if (m := modules.get("shardwise.utils._logging")) is not None:
        m._log_once.cache_clear()
        m._warn_once.cache_clear()
    if (m := modules.get("shardwise.utils.groups")) is not None:
        m._set_grid(None)
    if (m := modules.get("shardwise.tensor_parallel._comm")) is not None:
        m._COMMS.clear()
    if (m := modules.get("shardwise.comm._exit")) is not None:
        m._state.update(failure_status=None, exit_status=None)
    if (m := modules.get("shardwise.comm._functional")) is not None:
        m._communicators.clear()
    if (m := modules.get("shardwise.comm._logger")) is not None:
        m.comms_logger.__init__()
    if (m := modules.get("shardwise._host_memory")) is not None:
        m.host_memory.__init__()
    if (m := modules.get("shardwise.runtime.activation_checkpointing._settings")) is not None:
        m.SETTINGS.reset()
    if (m := modules.get("shardwise.runtime.activation_checkpointing._rng")) is not None:
        m.TRACKER.reset()
    if (m := modules.get("shardwise.ops.sparse_attention._block_sparse")) is not None:
        for cache in (m._plans, m._identity, m._block_masks):
            cache.clear()
        m._flex_state.update(compiled=None, failed=False, timed=set())


def _numpy_state():
    numpy = sys.modules.get("numpy")
    return numpy.random.get_state() if numpy is not None else None


def _logger_state(logger: logging.Logger) -> tuple:
    return logger.level, list(logger.handlers), logger.propagate, logger.disabled


def _set_logger_state(logger: logging.Logger, state: tuple) -> None:
    level, handlers, logger.propagate, logger.disabled = state
    logger.handlers[:] = handlers
    logger.setLevel(level)  # also empties the loggers' isEnabledFor caches
