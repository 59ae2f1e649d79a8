"""DeepSpeed's ZeRO-3 hook holder, ``engine.optimizer.parameter_offload``, as TRL uses it.

TRL generates under ZeRO-3 by gathering every parameter (``GatheredParameters``), then
removing DeepSpeed's forward and backward hooks so that no layer frees its parameters
after its forward, and registering them again afterwards (``remove_hooks`` /
``add_hooks`` in ``trl/models/utils.py``). Shardwise's stage 3 has no per-module hook
objects to remove; the same effect is ``Stage3Strategy.keep_gathered`` (a unit gathered
inside it stays whole until the block ends). This object gives TRL the names it touches
and maps them onto that block: removing a forward hook enters it, registering the module
again leaves it (freeing every unit), so generation gathers each unit once, not once per
token.
"""

from __future__ import annotations

import contextlib

from torch import nn


class _ModuleView:
    """``parameter_offload.module``: the module's parameters, and DeepSpeed's
    ``ds_external_parameters()`` (none beyond them: a parameter another module uses is
    still one of the model's own)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def named_parameters(self, *args, **kwargs):
        return self._module.named_parameters(*args, **kwargs)

    def ds_external_parameters(self) -> list:
        return []


class _ForwardHooks:
    """The forward hooks' handle: ``remove()`` keeps every unit whole from then on."""

    def __init__(self, owner: ParameterOffload) -> None:
        self._owner = owner

    def remove(self) -> None:
        self._owner.keep_whole()


class _TraceCoordinator:
    """``parameter_offload.param_coordinator``: shardwise records its gather order once
    and never invalidates it (a forward off the recorded order is gathered on demand)."""

    def is_invalid_trace(self) -> bool:
        return True

    def _invalidate_trace(self) -> None:
        """Nothing to invalidate (see the class docstring)."""


class ParameterOffload:
    """DeepSpeed's ``DeepSpeedZeRoOffload`` as far as TRL reads it: ``module``,
    ``forward_hooks``, ``backward_hooks``, ``param_coordinator`` and
    ``_register_deepspeed_module``. Each parameter gets DeepSpeed's
    ``ds_active_sub_modules`` set (TRL clears it; shardwise counts use per unit, so it
    stays empty)."""

    def __init__(self, strategy) -> None:
        self._strategy = strategy
        self._kept: contextlib.ExitStack | None = None
        """Open while the hooks are removed: inside the strategy's ``keep_gathered``."""
        self.module = _ModuleView(strategy.module)
        self.param_coordinator = _TraceCoordinator()
        self.forward_hooks: list = [_ForwardHooks(self)]
        self.backward_hooks: list = []
        for param in strategy.module.parameters():
            param.ds_active_sub_modules = set()

    def keep_whole(self) -> None:
        """The hooks are removed: every unit gathered from now on stays whole."""
        if self._kept is None:
            self._kept = contextlib.ExitStack()
            self._kept.enter_context(self._strategy.keep_gathered())

    def _register_deepspeed_module(self, module) -> None:
        """The hooks are back: free every unit kept whole, free them after each use again."""
        del module
        kept, self._kept = self._kept, None
        if kept is not None:
            kept.close()
        self.forward_hooks = [_ForwardHooks(self)]
        self.backward_hooks = []
