"""What ``shardwise.initialize`` does for a model with MoE layers: give each layer its
expert groups from the grid, refuse what this version cannot train with experts, and
tell the ZeRO strategy which parameters are reduced over which expert group."""

from __future__ import annotations

from torch import nn

from shardwise.config._components import ONEBIT_OPTIMIZERS
from shardwise.moe.layer import MoE
from shardwise.moe.utils import is_moe_param


def moe_layers(module: nn.Module) -> list[MoE]:
    """The MoE layers of ``module``, in module order."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def bind_moe_layers(module: nn.Module, grid, config, *, pipeline: bool = False) -> dict:
    """Build the expert groups every MoE layer of ``module`` needs (collective: the same
    sizes in the same order on every rank) and hand each layer its own, and the grid's
    tensor group to layers that split their experts over it. Returns the parameters
    replaced by tensor-parallel slices (old -> new)."""
    layers = moe_layers(module)
    if not layers:
        return {}
    names = ", ".join(sorted({f"ep_size={layer.ep_size}" for layer in layers}))
    refuse_unsupported(config, pipeline=pipeline, what=f"MoE layers ({names})")
    data_before_expert = bool(config.raw.get("use_data_before_expert_parallelism", False))
    for size in sorted({layer.ep_size for layer in layers}):
        grid.expert_groups(size, data_before_expert=data_before_expert)
    tensor_comm = grid.tensor_comm if grid.tensor > 1 else None
    replaced = {}
    for layer in layers:
        replaced.update(
            layer.bind(grid.expert_groups(layer.ep_size, data_before_expert=data_before_expert), tensor_comm)
        )
        if config.zero.stage == 3:  # a ZeRO-3 leaf (zero/_leaf.py): the gate reads its weight
            layer.deepspeed_moe._z3_leaf = True  # without calling its module
    return replaced


def expert_comms(module: nn.Module, grid) -> dict:
    """Expert parameters of ``module`` split over more than one rank -> the communicator of
    their expert-data-parallel group (see [Note: expert groups] in ``parallel/_expert.py``).
    Experts of an ``ep_size`` 1 layer are on every data rank: reduced like the rest."""
    if grid is None:
        return {}
    groups = grid.expert_group_dict
    out = {}
    for name, p in module.named_parameters():
        if not is_moe_param(p):
            continue
        group = groups.get(getattr(p, "group_name", None))
        if group is None:
            raise ValueError(
                f"parameter {name} is marked as an expert parameter (allreduce=False, group_name="
                f"{getattr(p, 'group_name', None)!r}) but no MoE layer of the model built that group; build "
                "experts with shardwise.moe.layer.MoE (or unmark the parameter)"
            )
        if group.ep_size > 1:
            out[p] = group.edp_comm
    return out


def refuse_unsupported(config, *, pipeline: bool, what: str) -> None:
    """Combinations this version cannot train with experts are errors, with the reason
    (``what``: the model's experts, in words)."""
    problems = []
    if pipeline:
        problems.append("a PipelineModule; build the model as one nn.Module")
    if config.optimizer is not None and config.optimizer.type in ONEBIT_OPTIMIZERS:
        problems.append(f"the {config.optimizer.type} optimizer (its compressed exchange is over the data group)")
    if problems:
        raise NotImplementedError(
            f"the model has {what}; this version of shardwise cannot train them with " + "; nor with ".join(problems)
        )
