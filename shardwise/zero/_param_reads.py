"""Stage 3 gathers a sharded parameter read during a forward, as DeepSpeed does.

[Note: reading a sharded parameter]
A unit is gathered around the forward of the modules that use it: its owner, and those
declared with ``register_external_parameter``. Code may also read a parameter through its
module's attribute inside another module's forward: a fused loss head multiplies by
``lm_head.weight`` without calling ``lm_head`` (TRL's chunked log-probabilities), and its
gradient then reaches a parameter that is empty unless the unit is gathered again. As in
DeepSpeed (which discovers such external parameters through each module's parameter
dictionary during the engine's forward), reading a parameter of a unit that is not
gathered, through its module's attribute, while the model's (the root module's) forward
runs, gathers the unit and makes the innermost hooked module whose forward is running one
of its users: from then on the unit is gathered before that module's forward and its
backward, like any declared external parameter. Shardwise hooks only the modules that use
units and the root, so the user may be an outer module than the one DeepSpeed picks (the
unit is then whole a little longer). Reads outside the model's forward (inspecting a
weight between steps, a checkpoint's recompute in backward) gather nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.zero._unit import UnitState


class GatherOnRead(dict):
    """A module's ``_parameters`` under stage 3: ``module.name`` asks the parameter's
    strategy to gather its unit when it is not whole (see the note above). It holds no state
    beyond the parameters, so copying or pickling a module copies only them."""

    __slots__ = ()

    def __getitem__(self, key: str):
        param = dict.__getitem__(self, key)
        owner = None if param is None else param.__dict__.get("_shardwise_unit")
        if owner is not None and owner[1].state is not UnitState.GATHERED and not torch.compiler.is_compiling():
            strategy, unit = owner
            strategy.gatherer.gather_for_read(unit)
        return param


def gather_on_read(root: nn.Module) -> None:
    """Make every module under ``root`` gather its sharded parameters when read in a forward."""
    for module in root.modules():
        if type(module._parameters) is dict and module._parameters:
            module._parameters = GatherOnRead(module._parameters)
