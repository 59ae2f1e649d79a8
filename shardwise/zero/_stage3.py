"""ZeRO stage 3: parameters partitioned too; each module gathers its own just in time.

Units: the parameters a module owns directly form one unit per optimizer param group
(a Linear's weight and bias, a LayerNorm's scale and shift). A parameter owned by more
than one module (tied embedding / output head) belongs to the root module's unit, which
stays gathered from the root's forward to the end of backward.

[Note: unshard and reshard by storage resize]
Each unit keeps a flat full-size buffer whose storage is freed (resized to 0 bytes)
while the unit is sharded; the module's parameters are views into it. Before the
module's forward the storage is re-allocated and all-gathered from every rank's fp32
shard; after the forward it is freed again. Autograd's saved tensors are views of the
same storage, so before the module's backward (a hook on its outputs' gradients) the
storage is gathered again, and it is freed once the unit's gradients have been copied
out for reduce-scatter. Peak live parameters are therefore the units in flight, not the
model.

Which units are gathered when (the module hooks, [Note: prefetch], reuse,
``keep_gathered`` and [Note: gathering swapped shards]) is the job of the
:class:`~shardwise.zero._gatherer.UnitGatherer` the strategy holds; a unit's states are
in ``_unit.py`` ([Note: unit states]). This module lays the units out and gives the
module state a unit at a time.

[Note: frozen units]
Parameters that take no gradient (``requires_grad=False``: a frozen base under LoRA
adapters, a frozen embedding, a reference model) are partitioned too, as DeepSpeed does:
after the trainable parameters' units they get units of their own (param group
``FROZEN_GROUP``, in no optimizer group; small ones go to a persistent unit of that group
as the rest), one per owning module, gathered for the forward and for the backward
through them like any unit. They have no gradient shard and are never reduced or
stepped. Their shard (``master``) is in the training dtype, as DeepSpeed's
``ds_tensor`` (nothing updates it, so no fp32 copy); it is the only copy a rank keeps,
and checkpoints save it as such (no fp32 master block). A frozen unit has no gradient
to say when its module's backward is done, so the gatherer frees it once the gradients
of the module's inputs are computed (``UnitGatherer._post_backward_hook``), or at the
end of backward.

Gradients are handled as in stage 2 (see ``_sharded.py``): copied to a staging buffer,
reduce-scattered per unit in a fixed order, accumulated into an fp32 shard. The
optimizer updates the fp32 shards; nothing is gathered after the step (the next forward
gathers what it needs).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from shardwise.config import ConfigError
from shardwise.zero._gatherer import UnitGatherer
from shardwise.zero._init import full_shape, gather_init_params, give_ds_id, init_shard
from shardwise.zero._leaf import unit_roots
from shardwise.zero._param_reads import gather_on_read
from shardwise.zero._parameter_offload import ParameterOffload
from shardwise.zero._partition import partition
from shardwise.zero._sharded import ShardedStrategy
from shardwise.zero._unit import Stage3Unit, ZeroParamStatus
from shardwise.zero._views import Stage3Views

FROZEN_GROUP = -2
"""The param group of frozen units (-1 is trainable parameters no optimizer group holds)."""


class Stage3Strategy(ShardedStrategy):
    """ZeRO stage 3 (see the module docstring). Arguments as :class:`ShardedStrategy`."""

    def __init__(
        self,
        module: nn.Module,
        *,
        prefetch_numel: int = 50_000_000,
        max_live_numel: int = 1_000_000_000,
        max_reuse_distance: int = 1_000_000_000,
        persistence_threshold: int = 0,
        param_offload=None,
        **kwargs,
    ):
        _make_whole([p for p in module.parameters() if not p.is_floating_point() and init_shard(p) is not None])
        super().__init__(module, stage=3, **kwargs)
        self.gatherer = UnitGatherer(
            self,
            param_offload=param_offload if param_offload is not None and param_offload.enabled else None,
            prefetch_numel=prefetch_numel,
            max_live_numel=max_live_numel,
            max_reuse_distance=max_reuse_distance,
        )
        self.views = Stage3Views(self)
        self.persistence_threshold = persistence_threshold
        self._owner, self._sharers = self._owners(module)
        self.frozen = [p for p in module.parameters() if not p.requires_grad and p.is_floating_point()]
        """Parameters that take no gradient: partitioned in units of their own (see [Note:
        frozen units]). Integer ones (quantized weights) stay whole: a unit's buffer is
        in the training dtype."""
        self._persistent_params: dict[tuple[int, int], list[nn.Parameter]] = {}
        """(param group, id of its bucket's communicator) -> small parameters kept whole."""

    @property
    def peak_live_numel(self) -> int:
        """The most elements of non-persistent units gathered at once (tests bound it)."""
        return self.gatherer.peak_live_numel

    @property
    def peak_param_buffers(self) -> int:
        """The most parameter read buffers held at once (tests bound it by
        offload_param.buffer_count)."""
        return self.gatherer.peak_param_buffers

    def unit_of(self, param: nn.Parameter) -> Stage3Unit:
        """The unit ``param`` belongs to."""
        return self._bucket_of[param]

    @staticmethod
    def _owners(root: nn.Module):
        """Each parameter's unit owner, and the modules sharing each shared parameter."""
        owners: dict[nn.Parameter, list[nn.Module]] = {}
        for module in root.modules():
            for p in module._parameters.values():
                if p is not None:
                    owners.setdefault(p, []).append(module)
        owner = {p: (mods[0] if len(mods) == 1 else root) for p, mods in owners.items()}
        for leaf in reversed(unit_roots(root)):  # outer leaves come last: they win
            owner.update({p: leaf for p in leaf.parameters() if p in owner and len(owners[p]) == 1})
        sharers = {p: mods for p, mods in owners.items() if len(mods) > 1}
        return owner, sharers

    # -- layout: one unit per (owning module, param group) -----------------------------------

    def without_optimizer(self, params: list) -> None:
        """An engine with no optimizer (TRL's and DeepSpeed-Chat's reference and reward
        models) partitions the model as DeepSpeed does, whether it was built by ``zero.Init``
        or whole: lay the units out anyway (their gradient shards cost no memory until a
        backward writes them)."""
        self.optimizer_params(params)

    def optimizer_params(self, model_parameters) -> list[dict]:
        """Units for every owning module, then the frozen units (see [Note: frozen units]),
        then one persistent unit per param group (laid out last, so waiting for its
        gradients delays no other unit's reduction)."""
        super().optimizer_params(model_parameters)
        if self.frozen:
            self._layout(list(reversed(self.frozen)), FROZEN_GROUP)
        for (group, _), params in self._persistent_params.items():
            self._add_bucket(params, group, module=self.module, persistent=True)
        self._persistent_params.clear()
        self._check_param_buffer_size()
        self.gatherer.watch(self.module)  # see [Note: reading a sharded parameter]
        gather_on_read(self.module)
        return [
            {**options, "params": [b.master for b in self.buckets if b.group == g]}
            for g, options in enumerate(self._group_options)
        ]

    def _layout(self, params: list[nn.Parameter], group: int) -> None:
        # one unit per (owner, communicator): an MoE leaf's experts are sharded over their
        # expert-data-parallel group, its gate over the data group
        by_owner: dict[tuple[nn.Module, int], list[nn.Parameter]] = {}
        for p in params:
            if full_shape(p).numel() < self.persistence_threshold:
                self._persistent_params.setdefault((group, id(self._comm_of(p))), []).append(p)
                continue
            by_owner.setdefault((self._owner[p], id(self._comm_of(p))), []).append(p)
        for (owner, _), owned in by_owner.items():
            self._add_bucket(owned, group, module=owner)
            unit = self.buckets[-1]
            self.gatherer.add_user(owner, unit)
            for sharer in {m for p in owned for m in self._sharers.get(p, ())}:
                self.gatherer.add_sharer(sharer, unit)
            self.gatherer.reshard(unit, force=True)
        for user in self.module.modules():  # register_external_parameter calls made before layout
            for p in user.__dict__.pop("_shardwise_external_params", []):
                if p in self._bucket_of:
                    self.add_external_user(user, self._bucket_of[p])

    def _add_bucket(
        self, params: list[nn.Parameter], group: int, *, module: nn.Module, persistent: bool = False
    ) -> None:
        """A unit: flat buffer of the full parameters (freed right away), an fp32 master
        shard and an fp32 gradient shard. Parameters built by ``zero.Init`` arrive as
        per-parameter slices and are gathered here one unit at a time."""
        comm = self._comm_of(params[0])
        rank, device = comm.rank, params[0].device
        dtype = self.policy.param_dtype
        shapes = [full_shape(p) for p in params]
        offsets, numel = [], 0
        for shape in shapes:
            offsets.append(numel)
            numel += shape.numel()
        padded, shard = partition(numel, comm.world_size)
        flat = torch.zeros(padded, dtype=dtype, device=device)
        built_partitioned = [p for p in params if init_shard(p) is not None]
        gather_init_params(built_partitioned)
        with torch.no_grad():
            for p, off, shape in zip(params, offsets, shapes):
                flat[off : off + shape.numel()].copy_(p.detach().reshape(-1))
                p.data = flat[off : off + shape.numel()].view(shape)
        for p in built_partitioned:
            del p._shardwise_init, p.ds_tensor
            p.__dict__.pop("__deepcopy__", None)
        unit = Stage3Unit(
            len(self.buckets),
            group,
            params,
            offsets,
            numel,
            padded,
            shard,
            flat,
            shapes=shapes,
            comm=comm,
            module=module,
            persistent=persistent,
        )
        self.gatherer.count_live(unit, +1)
        host = self._master_device(device)
        shard_dtype = dtype if group == FROZEN_GROUP else torch.float32  # see [Note: frozen units]
        unit.master = nn.Parameter(self._host_tensor(unit.local(flat, rank).detach().to(host, shard_dtype, copy=True)))
        if group == FROZEN_GROUP:  # see [Note: frozen units]
            unit.frozen = True
            unit.master.requires_grad_(False)
        else:
            unit.grad_shard = self._new_grad_shard(shard, host)
            unit.master.grad = unit.grad_shard
        for p, shape, off in zip(params, shapes, offsets):
            p._shardwise_unit = (self, unit)  # found by GatheredParameters
            p.ds_shape, p.ds_numel = shape, shape.numel()  # DeepSpeed's names for the full size
            p.ds_tensor = _rank_piece(unit.master, off, shape.numel(), rank * shard)
            give_ds_id(p)
            p.ds_status = ZeroParamStatus.AVAILABLE  # laid out whole; freeing the unit changes it
        self.buckets.append(unit)
        self._bucket_of.update(dict.fromkeys(params, unit))
        self._offset_of.update(zip(params, offsets))

    def _check_param_buffer_size(self) -> None:
        """Every unit shard swapped with offload_param nvme must fit one read buffer (the
        same layout on every rank, so every rank raises)."""
        param_offload = self.gatherer.param_offload
        if param_offload is None or param_offload.device != "nvme":
            return
        size, pinned = param_offload.buffer_size, self.gatherer.pinned_masters()
        too_large = [u for u in self.buckets if u.index not in pinned and u.shard > size]
        if too_large:
            unit = max(too_large, key=lambda u: u.shard)
            raise ConfigError(
                f"zero_optimization.offload_param.buffer_size={size} elements is smaller than the "
                f"parameter shard of {type(unit.module).__name__} ({', '.join(self.names[p] for p in unit.params)}: "
                f"{unit.shard} elements per rank); raise buffer_size to at least {unit.shard}, use more "
                "ranks, or keep those parameters in CPU memory with offload_param.max_in_cpu"
            )

    def add_external_user(self, module: nn.Module, unit: Stage3Unit) -> None:
        """Gather ``unit`` for ``module``'s forward and backward too (its owner is elsewhere)."""
        self.gatherer.add_user(module, unit)

    @contextlib.contextmanager
    def keep_gathered(self):
        """Keep every unit whole from its first gather until the block ends, then free them
        all (before the optimizer step changes the shards): a pipeline stage runs many
        micro-batches through the same layers in one batch, and each would otherwise
        gather every unit twice (forward and backward). Costs the units' full parameters
        for the block, over ``stage3_max_live_parameters`` if need be."""
        with self.gatherer.keep_gathered():
            yield

    def adopt_client_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """As every sharded stage, and the optimizer gets DeepSpeed's ``parameter_offload``
        (the ZeRO-3 hooks TRL removes around generation; see ``_parameter_offload.py``)."""
        optimizer = super().adopt_client_optimizer(optimizer)
        optimizer.parameter_offload = ParameterOffload(self)
        return optimizer

    def gather_units(self, units) -> None:
        """Gather the given units (collective); see ``GatheredParameters``."""
        for unit in units:
            self.gatherer.unshard(unit)

    def release_units(self, units, *, modifier_rank: int | None) -> None:
        """Take modifications from ``modifier_rank`` (if any) into the shards, then free."""
        with torch.no_grad():
            for unit in units:
                if modifier_rank is not None:
                    if unit.comm is not self.comm:
                        raise NotImplementedError(
                            "GatheredParameters(modifier_rank=...) over expert parameters split over ranks: "
                            "each expert-parallel rank holds other experts; modify them with modifier_rank=None "
                            "on every rank holding them"
                        )
                    self.comm.broadcast(unit.flat_param, src=modifier_rank, tag="GatheredParameters").wait()
                    with self._resident([unit]):
                        unit.master.copy_(unit.local(unit.flat_param, self.comm.rank))
                self.gatherer.reshard(unit, force=not self.gatherer.keeping)


def _make_whole(params: list[nn.Parameter]) -> None:
    """Gather parameters built partitioned by ``zero.Init`` for good (integer weights, which
    no unit holds); each keeps its ``ds_id``."""
    if not params:
        return
    gather_init_params(params)
    for p in params:
        p.data = p.data.clone()
        del p._shardwise_init, p.ds_tensor
        p.__dict__.pop("__deepcopy__", None)
        p.ds_status = ZeroParamStatus.AVAILABLE


def _rank_piece(master: torch.Tensor, offset: int, numel: int, shard_start: int) -> torch.Tensor:
    """DeepSpeed's ``param.ds_tensor``: this rank's piece of one parameter, a view of the
    unit's master shard (fp32; a frozen unit's is in the training dtype). Scripts test
    ``hasattr(p, "ds_tensor")`` to tell a partitioned parameter and count ``ds_numel``
    then (DeepSpeed-Chat's throughput print).
    A unit is sharded flat, so a piece is this rank's overlap with the parameter: any
    length from 0 to the whole shard, not DeepSpeed's even ceil(numel / world)."""
    begin = min(max(offset - shard_start, 0), master.numel())
    end = min(max(offset + numel - shard_start, 0), master.numel())
    return master.detach()[begin:end]
