"""Which names of a checkpoint this rank holds: one function of the module and the grid.

A checkpoint stores one model's tensors whole, by name (see [Note: tensor parallelism in
checkpoints] and [Note: pipeline stages in checkpoints] in ``_checkpointing.py``).
``placement`` answers once, at each save or load, where this rank's part of them is: the
state-dict keys of its pipeline stage's layers, the tensor-parallel slice of each split
parameter, its data rank (whose shard of each ZeRO bucket it writes), and the tied
weights an earlier stage writes. The checkpoint functions read this and the engine's
stateful parts (``_checkpoint_state.py``), never the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import nn

from shardwise.checkpoint import TensorSplit
from shardwise.moe._autoep import ExpertParallel, stacked_names
from shardwise.moe.layer import MoE
from shardwise.runtime._checkpoint_parts import Writers
from shardwise.zero._strategy import is_tensor_parallel


@dataclass(frozen=True)
class ExpertNames:
    """Where the experts split over ranks sit in a checkpoint: stored under their global
    id (see [Note: experts in checkpoints] in ``_checkpointing.py``)."""

    stored: dict[str, str]
    """This rank's expert state-dict keys (also their parameter names) -> stored names."""
    others: frozenset[str]
    """Stored names of the experts the other expert-parallel ranks hold."""
    holders: dict[str, tuple[int, int]]
    """This rank's expert keys -> (its rank, their number) among the ranks holding the
    same expert (the expert-data-parallel group): who writes which part of it."""
    split_keys: frozenset[str] = frozenset()
    """Stacked expert weights of AutoEP (``moe/_autoep.py``): this rank holds rows of the
    stored tensor, described by a ``TensorSplit`` along dim 0 in ``Placement.splits``."""

    def store(self, name: str) -> str:
        return self.stored.get(name, name)

    @cached_property
    def local(self) -> dict[str, str]:
        return {stored: local for local, stored in self.stored.items()}

    def own(self, state: dict) -> dict:
        """Of entries by stored name, this rank's, by its own names (the others' dropped)."""
        return {self.local.get(k, k): v for k, v in state.items() if k not in self.others}


@dataclass(frozen=True)
class Placement:
    """This rank's part of a checkpoint (built by :func:`placement`)."""

    writers: Writers
    """The ranks saving together (the pipe x data x tensor grid) and this rank among them;
    data rank ``r`` writes shard ``r`` of every ZeRO bucket."""
    global_rank: int
    zero_stage: int
    keys: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    """Each state-dict key of this stage's layers: its dtype and its shape as stored (the
    full tensor, for a tensor-parallel slice or a ZeRO-3 partitioned parameter)."""
    name_of_key: dict[str, str]
    """State-dict key -> the parameter it belongs to (a tied key: the parameter's first
    name); buffers are absent."""
    params: frozenset[str]
    """The parameter names this stage holds."""
    splits: dict[str, TensorSplit]
    """Each tensor-parallel parameter's slice, by parameter name; empty without tensor
    parallelism."""
    tied_elsewhere: frozenset[str]
    """Tied weights this stage holds but an earlier stage writes."""
    aliases: dict[str, str]
    """State-dict keys naming a tensor an earlier key already names (tied weights)."""
    experts: ExpertNames | None = field(default=None)
    """How this rank's experts are stored; None when no MoE layer splits its experts."""
    frozen: frozenset[str] = frozenset()
    """The parameter names this stage holds that take no gradient (``requires_grad=False``)."""

    @property
    def frozen_keys(self) -> list[str]:
        """The state-dict keys of the frozen parameters (a tied one under each key)."""
        return [key for key, name in self.name_of_key.items() if name in self.frozen]

    def store(self, name: str) -> str:
        """The name ``name`` (a state-dict key or parameter name) is stored under."""
        return name if self.experts is None else self.experts.store(name)

    @property
    def stored_splits(self) -> dict[str, TensorSplit]:
        """``splits`` by the names they are stored under (experts by global id, so a
        tensor-parallel expert's slice is written into its global tensor)."""
        if self.experts is None:
            return self.splits
        return {self.store(name): split for name, split in self.splits.items()}

    @property
    def split_by_key(self) -> dict[str, TensorSplit]:
        """``splits`` by state-dict key (a tied parameter under each of its keys)."""
        return {key: self.splits[name] for key, name in self.name_of_key.items() if name in self.splits}

    def stage_module_state(self, state: dict) -> dict:
        """Of a whole model's module state, what this stage's layers (and this rank's
        experts, by their local names) hold."""
        if self.experts is not None:
            state = self.experts.own(state)
        if self.writers.stages == 1:
            return state
        return {k: v for k, v in state.items() if k in self.keys}

    def stage_optimizer_state(self, state: dict) -> dict:
        """Of a whole model's named optimizer state, what this stage's parameters (and this
        rank's experts, by their local names) hold."""
        if self.experts is not None:
            own = self.experts.own
            state = {
                **state,
                "state": own(state["state"]),
                "master": own(state.get("master", {})),
                "param_groups": [dict(g, params=list(own(dict.fromkeys(g["params"])))) for g in state["param_groups"]],
            }
        if self.writers.stages == 1:
            return state
        names = self.params
        return {
            **state,
            "state": {n: v for n, v in state["state"].items() if n in names},
            "master": {n: v for n, v in state.get("master", {}).items() if n in names},
            "param_groups": [dict(g, params=[n for n in g["params"] if n in names]) for g in state["param_groups"]],
        }

    def layout(self, param_dtype: torch.dtype) -> dict:
        """The manifest's ``layout`` entry."""
        writers = self.writers
        return {
            "zero_stage": self.zero_stage,
            "dp_world_size": writers.data.world_size,
            "tp_degree": writers.tensor_size,
            "pp_degree": writers.stages,
            "param_dtype": str(param_dtype).removeprefix("torch."),
        }

    def describe(self) -> str:
        """The layout in words, as errors name it."""
        writers = self.writers
        return f"ZeRO stage {self.zero_stage}, data {writers.data.world_size} x tensor {writers.tensor_size}" + (
            f" x pipe {writers.stages}" if writers.stages > 1 else ""
        )


def placement(module: nn.Module, grid, *, zero_stage: int) -> Placement:
    """Where this rank's part of ``module``'s checkpoint is, on ``grid`` (the engine's
    ``ParallelGrid``) at ``zero_stage``."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    current = module.state_dict(keep_vars=True)
    experts = expert_names(module)
    splits = {**tensor_splits(module, grid), **expert_splits(module)}
    name_of_key = {key: name_of[id(t)] for key, t in current.items() if id(t) in name_of}
    keys = {}
    for key, tensor in current.items():
        split = splits.get(name_of_key.get(key))
        shape = split.stored_shape if split is not None else tuple(getattr(tensor, "ds_shape", tensor.shape))
        keys[key] = (tensor.dtype, tuple(int(d) for d in shape))
    return Placement(
        Writers.of(grid),
        grid.global_rank,
        zero_stage,
        keys,
        name_of_key,
        frozenset(name_of.values()),
        splits,
        _tied_elsewhere(module, grid, name_of),
        _aliases(current),
        experts,
        frozenset(name for name, p in module.named_parameters() if not p.requires_grad),
    )


def expert_names(module: nn.Module) -> ExpertNames | None:
    """The stored names of the experts of ``module``'s MoE layers that split them over
    ranks (local expert ``i`` of expert rank ``r`` is global expert ``r * local + i``)."""
    stored, others, holders = {}, set(), {}
    state_keys = list(module.state_dict(keep_vars=True))
    split_keys = set()
    for path, layer in module.named_modules():
        if isinstance(layer, ExpertParallel):
            for key in _stacked_keys(path, layer):
                split_keys.add(key)
                holders[key] = (layer.expert_groups.edp_comm.rank, layer.expert_groups.edp_comm.world_size)
            continue
        if not isinstance(layer, MoE) or layer.ep_size == 1:
            continue
        groups = layer.expert_groups
        prefix = (
            f"{path}.deepspeed_moe.experts.deepspeed_experts." if path else "deepspeed_moe.experts.deepspeed_experts."
        )
        local = layer.num_local_experts
        for key in state_keys:
            if not key.startswith(prefix):
                continue
            index, rest = key[len(prefix) :].split(".", 1)
            stored[key] = f"{prefix}{groups.ep_rank * local + int(index)}.{rest}"
            holders[key] = (groups.edp_comm.rank, groups.edp_comm.world_size)
            others.update(
                f"{prefix}{r * local + int(index)}.{rest}" for r in range(layer.ep_size) if r != groups.ep_rank
            )
    return ExpertNames(stored, frozenset(others), holders, frozenset(split_keys)) if holders else None


def _stacked_keys(path: str, experts: nn.Module) -> list[str]:
    """State-dict keys of an AutoEP experts module's stacked (row-split) weights."""
    prefix = f"{path}." if path else ""
    return [prefix + name for name in stacked_names(experts, experts.num_experts)]


def expert_splits(module: nn.Module) -> dict[str, TensorSplit]:
    """Each AutoEP stacked expert weight's rows, as a split along dim 0 of the stored
    tensor (see [Note: experts in checkpoints] in ``_checkpointing.py``)."""
    splits = {}
    for path, layer in module.named_modules():
        if isinstance(layer, ExpertParallel):
            groups = layer.expert_groups
            for key in _stacked_keys(path, layer):
                held = layer.get_parameter(key.rsplit(".", 1)[-1])
                full = (held.shape[0] * groups.ep_size, *held.shape[1:])
                splits[key] = TensorSplit(full, 0, groups.ep_rank, groups.ep_size)
    return splits


def _aliases(current: dict) -> dict[str, str]:
    first: dict[int, str] = {}
    aliases = {}
    for key, tensor in current.items():
        if id(tensor) in first:
            aliases[key] = first[id(tensor)]
        else:
            first[id(tensor)] = key
    return aliases


def _tied_elsewhere(module: nn.Module, grid, name_of: dict[int, str]) -> frozenset[str]:
    """Names of the tied weights this stage holds but an earlier stage writes (see [Note:
    pipeline stages in checkpoints] in ``_checkpointing.py``)."""
    tied = getattr(module, "tied_weights", None)
    if grid.pipe == 1 or tied is None:
        return frozenset()
    return frozenset(name_of[id(param)] for _, param, ranks, _ in tied() if grid.global_rank != min(ranks))


def tensor_splits(module: nn.Module, grid) -> dict[str, TensorSplit]:
    """Each tensor-parallel parameter's slice, by parameter name (see [Note: tensor
    parallelism in checkpoints] in ``_checkpointing.py``); empty without tensor parallelism."""
    if grid.tensor == 1:
        return {}
    return {name: split for name, p in module.named_parameters() if (split := _split_of(name, p, grid)) is not None}


def _split_of(name: str, param, grid) -> TensorSplit | None:
    """Where ``param`` sits in its full tensor, from the marks tensor-parallel layers set
    (shardwise's ``tensor_parallel_shard``; Megatron's ``partition_dim`` / ``partition_stride``)."""
    if not is_tensor_parallel(param):
        return None
    stride = int(getattr(param, "partition_stride", 1) or 1)
    transposed = bool(getattr(param, "tensor_parallel_transposed", False))
    info = getattr(param, "tensor_parallel_shard", None)
    if info is not None:
        if (info.parts, info.index) != (grid.tensor, grid.tensor_rank):
            raise NotImplementedError(
                f"parameter {name} is slice {info.index} of {info.parts}, but this rank is "
                f"tensor rank {grid.tensor_rank} of {grid.tensor}: checkpoints store slices "
                "split over the grid's tensor group only"
            )
        return TensorSplit(tuple(info.full_shape), info.dim, info.index, info.parts, stride, transposed)
    dim = getattr(param, "partition_dim", None)
    if dim is None:
        raise NotImplementedError(
            f"parameter {name} is marked tensor-parallel but has no partition_dim, so a "
            "checkpoint cannot tell where its slice belongs; set param.partition_dim "
            "(and partition_stride) as Megatron's layers do"
        )
    full = list(getattr(param, "ds_shape", param.shape))
    full[dim] *= grid.tensor
    return TensorSplit(tuple(full), dim, grid.tensor_rank, grid.tensor, stride, transposed)
