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

[Note: prefetch]
The first step records the order in which units are gathered in forward. From then on,
gathering a unit for forward also launches the all-gathers of the units that followed
it, and gathering one for backward launches those that preceded it, up to
``stage3_prefetch_bucket_size`` elements in flight, so communication overlaps compute.
The decision depends only on the recorded order, which every rank shares, so ranks
issue the same collectives in the same order; a prefetched unit that is not used is
waited for and freed.

[Note: gathering swapped shards]
With ``offload_param.device = "nvme"`` a unit's fp32 shard lives in a swap file between
uses. Starting to gather it (for use or prefetch) starts the file read in the I/O
threads; the all-gather needs the bytes, and all ranks must launch collectives in the
same order, so a unit's all-gather is launched from the main thread when a unit is
needed, together with those of every unit whose read began before it, in the order the
reads began (the same on every rank). Reads issued by prefetch therefore overlap the
compute of the units before them, and their all-gathers overlap the unit being used. A
read nobody used is dropped without a collective.

The read buffers form a pool of ``offload_param.buffer_count`` buffers of at most
``offload_param.buffer_size`` elements: a unit holds one from the start of its read until
its all-gather completes. Prefetch stops when the pool is empty; a unit needed while it is
empty first completes the oldest gathers in flight (every rank counts the same buffers at
the same points, so all still launch the same collectives in the same order). A unit
shard larger than ``buffer_size`` is a configuration error at start-up.

Gradients are handled as in stage 2 (see ``_sharded.py``): copied to a staging buffer,
reduce-scattered per unit in a fixed order, accumulated into an fp32 shard. The
optimizer updates the fp32 shards; nothing is gathered after the step (the next forward
gathers what it needs).
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from shardwise.config import ConfigError
from shardwise.offload import to_device
from shardwise.zero._leaf import unit_roots
from shardwise.zero._init import full_shape, gather_init_params, init_shard
from shardwise.zero._partition import partition
from shardwise.zero._sharded import ShardedStrategy
from shardwise.zero._strategy import PARAM_KEY, ModelStateBytes
from shardwise.zero._stage0 import optimizer_state_bytes
from shardwise.zero._unit import Stage3Unit, UnitState


class Stage3Strategy(ShardedStrategy):
    """ZeRO stage 3 (see the module docstring). Arguments as :class:`ShardedStrategy`."""

    def __init__(self, module: nn.Module, *, prefetch_numel: int = 50_000_000,
                 max_live_numel: int = 1_000_000_000, max_reuse_distance: int = 1_000_000_000,
                 persistence_threshold: int = 0, param_offload=None, **kwargs):
        self.param_offload = param_offload if param_offload is not None and param_offload.enabled else None
        frozen = [p for p in module.parameters() if init_shard(p) is not None and not p.requires_grad]
        if frozen:  # frozen parameters stay whole at stage 3 (they have no unit yet)
            gather_init_params(frozen)
            for p in frozen:
                p.data = p.data.clone()
                del p._shardwise_init, p.ds_tensor
                p.__dict__.pop("__deepcopy__", None)
        super().__init__(module, stage=3, **kwargs)
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.persistence_threshold = persistence_threshold
        self.live_numel = 0
        """Elements of the non-persistent units gathered (or being gathered) right now."""
        self.peak_live_numel = 0
        """The most ``live_numel`` has been since construction (tests bound it)."""
        self._owner, self._sharers = self._owners(module)
        self._persistent_params: dict[int, list[nn.Parameter]] = {}
        self._forward_order: list[Stage3Unit] = []
        self._trace: list[Stage3Unit] = []
        """Units in the order the first step's forward gathered them, repeats included."""
        self._reuse_distance: list[float] = []
        self._cursor = 0
        self._order_recorded = False
        self._keeping = False
        """Inside ``keep_gathered``: units stay whole until it ends."""
        self._units_of: dict[nn.Module, list[Stage3Unit]] = {}
        self._reading: collections.deque[Stage3Unit] = collections.deque()
        """Units whose shards are being read from swap files, in the order the reads began."""
        self._holding: collections.deque[Stage3Unit] = collections.deque()
        """Units holding a parameter read buffer (read or all-gather not complete), oldest first."""
        self.peak_param_buffers = 0
        """The most read buffers held at once (tests bound it by offload_param.buffer_count)."""
        self._in_backward_root = False

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

    def optimizer_params(self, model_parameters) -> list[dict]:
        """Units for every owning module, then one persistent unit per param group (laid
        out last, so waiting for its gradients delays no other unit's reduction)."""
        super().optimizer_params(model_parameters)
        for group, params in self._persistent_params.items():
            self._add_bucket(params, group, module=self.module, persistent=True)
        self._persistent_params.clear()
        self._check_param_buffer_size()
        return [{**options, "params": [b.master for b in self.buckets if b.group == g]}
                for g, options in enumerate(self._group_options)]

    def _layout(self, params: list[nn.Parameter], group: int) -> None:
        by_owner: dict[nn.Module, list[nn.Parameter]] = {}
        for p in params:
            if full_shape(p).numel() < self.persistence_threshold:
                self._persistent_params.setdefault(group, []).append(p)
                continue
            by_owner.setdefault(self._owner[p], []).append(p)
        for owner, owned in by_owner.items():
            self._add_bucket(owned, group, module=owner)
            unit = self.buckets[-1]
            if owner not in self._units_of:
                self._units_of[owner] = []
                owner.register_forward_pre_hook(self._pre_forward)
                owner.register_forward_hook(self._post_forward)
            self._units_of[owner].append(unit)
            for sharer in {m for p in owned for m in self._sharers.get(p, ())}:
                # a module using a shared parameter gathers the root unit when called on its own
                sharer.register_forward_pre_hook(lambda module, args, unit=unit: self._unshard(unit))
            self._reshard(unit, force=True)
        for user in self.module.modules():  # register_external_parameter calls made before layout
            for p in user.__dict__.pop("_shardwise_external_params", []):
                if p in self._bucket_of:
                    self.add_external_user(user, self._bucket_of[p])

    def _add_bucket(self, params: list[nn.Parameter], group: int, *, module: nn.Module,
                    persistent: bool = False) -> None:
        """A unit: flat buffer of the full parameters (freed right away), an fp32 master
        shard and an fp32 gradient shard. Parameters built by ``zero.Init`` arrive as
        per-parameter slices and are gathered here one unit at a time."""
        rank, device = self.comm.rank, params[0].device
        dtype = self.policy.param_dtype
        shapes = [full_shape(p) for p in params]
        offsets, numel = [], 0
        for shape in shapes:
            offsets.append(numel)
            numel += shape.numel()
        padded, shard = partition(numel, self.comm.world_size)
        flat = torch.zeros(padded, dtype=dtype, device=device)
        built_partitioned = [p for p in params if init_shard(p) is not None]
        gather_init_params(built_partitioned)
        with torch.no_grad():
            for p, off, shape in zip(params, offsets, shapes):
                flat[off:off + shape.numel()].copy_(p.detach().reshape(-1))
                p.data = flat[off:off + shape.numel()].view(shape)
        for p in built_partitioned:
            del p._shardwise_init, p.ds_tensor
            p.__dict__.pop("__deepcopy__", None)
        unit = Stage3Unit(len(self.buckets), group, params, offsets, numel, padded, shard, flat, shapes=shapes,
                          module=module, persistent=persistent)
        self._count_live(unit, +1)
        host = self._master_device(device)
        unit.master = nn.Parameter(self._host_tensor(unit.local(flat, rank).detach().to(host, torch.float32, copy=True)))
        unit.grad_shard = self._new_grad_shard(shard, host)
        unit.master.grad = unit.grad_shard
        for p, shape in zip(params, shapes):
            p._shardwise_unit = (self, unit)  # found by GatheredParameters
            p.ds_shape, p.ds_numel = shape, shape.numel()  # DeepSpeed's names for the full size
        self.buckets.append(unit)
        self._bucket_of.update({p: unit for p in params})
        self._offset_of.update(zip(params, offsets))

    def _is_root(self, unit: Stage3Unit) -> bool:
        return unit.module is self.module

    def _count_live(self, unit: Stage3Unit, sign: int) -> None:
        if not unit.persistent:
            self.live_numel += sign * unit.padded
            self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _start_unshard(self, unit: Stage3Unit) -> None:
        """Allocate the unit's full buffer and launch its all-gather (see [Note: prefetch]).
        A shard in a swap file (offload_param nvme) is read first: see [Note: gathering
        swapped shards]."""
        if unit.state is not UnitState.SHARDED:
            return
        self._count_live(unit, +1)
        if self._needs_read(unit):
            while len(self._holding) >= self.param_offload.buffer_count:
                self._finish_gather(self._holding[0])  # free the oldest buffer
            unit.begin_read(self.swapper.read_master(unit.index))
            self._reading.append(unit)
            self._holding.append(unit)
            self.peak_param_buffers = max(self.peak_param_buffers, len(self._holding))
            return
        self._launch_gather(unit, unit.master.detach())

    def _needs_read(self, unit: Stage3Unit) -> bool:
        """Whether gathering ``unit`` starts with reading its shard from a swap file."""
        return self.swapper is not None and self.swapper.master_swapped(unit.index)

    def _finish_gather(self, unit: Stage3Unit) -> None:
        """Complete ``unit``'s read (launching the gathers read before it) and all-gather,
        and point its parameters at the full buffer."""
        with self.timer("gather_params"):
            if unit.state is UnitState.READING:
                self._gather_read(unit)
            unit.finish_gather()
        self._release_buffer(unit)

    def _release_buffer(self, unit: Stage3Unit) -> None:
        if unit in self._holding:
            self._holding.remove(unit)

    def _launch_gather(self, unit: Stage3Unit, shard: torch.Tensor) -> None:
        tag = f"parameters of unit {unit.index} ({type(unit.module).__name__})"
        unit.begin_gather(lambda flat: self.comm.all_gather_into_tensor(
            flat, to_device(shard, flat.device, flat.dtype), tag=tag))

    def _gather_read(self, upto: Stage3Unit) -> None:
        """Launch the all-gathers of units whose shards were being read, in the order the
        reads started, up to ``upto``. See [Note: gathering swapped shards]."""
        while self._reading:
            unit = self._reading.popleft()
            self._launch_gather(unit, unit.take_read())
            if unit is upto:
                return

    def _offloads(self) -> bool:
        """Offloading parameters or the optimizer puts the fp32 shards in CPU memory."""
        return self.offload is not None or self.param_offload is not None

    def _swap_masters(self) -> bool:
        """The masters are the parameter shards: swapped only with offload_param nvme."""
        return self.param_offload is not None and self.param_offload.device == "nvme"

    def _pinned_masters(self) -> frozenset[int]:
        """Persistent units, then the first units up to offload_param.max_in_cpu elements."""
        pinned, budget = set(), self.param_offload.max_in_cpu if self.param_offload is not None else 0
        for unit in self.buckets:
            if unit.persistent:
                pinned.add(unit.index)
            elif unit.master.numel() <= budget:
                budget -= unit.master.numel()
                pinned.add(unit.index)
        return frozenset(pinned)

    def _check_param_buffer_size(self) -> None:
        """Every unit shard swapped with offload_param nvme must fit one read buffer (the
        same layout on every rank, so every rank raises)."""
        if self.param_offload is None or self.param_offload.device != "nvme":
            return
        size, pinned = self.param_offload.buffer_size, self._pinned_masters()
        too_large = [u for u in self.buckets if u.index not in pinned and u.shard > size]
        if too_large:
            unit = max(too_large, key=lambda u: u.shard)
            raise ConfigError(
                f"zero_optimization.offload_param.buffer_size={size} elements is smaller than the "
                f"parameter shard of {type(unit.module).__name__} ({', '.join(self.names[p] for p in unit.params)}: "
                f"{unit.shard} elements per rank); raise buffer_size to at least {unit.shard}, use more "
                "ranks, or keep those parameters in CPU memory with offload_param.max_in_cpu")

    def _unshard(self, unit: Stage3Unit) -> None:
        if unit.state is UnitState.GATHERED:
            return
        self._start_unshard(unit)
        self._finish_gather(unit)

    def _reshard(self, unit: Stage3Unit, *, force: bool = False) -> None:
        if unit.persistent or unit.state is UnitState.SHARDED:
            return  # persistent units stay whole; a sharded unit has nothing to free
        if not force and (self._is_root(unit) or self._keeping):
            return  # tied / shared parameters stay gathered until backward ends; see keep_gathered
        if unit.state is UnitState.READING:  # a prefetched read nobody used: no collective
            self._reading.remove(unit)
        self._release_buffer(unit)
        unit.free()  # a prefetched all-gather nobody used is waited for
        self._count_live(unit, -1)

    # -- hooks ------------------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args) -> None:
        self._ensure_layout()
        if module is self.module:
            self._cursor = 0  # a new forward
        units = self._units_of.get(module, ())
        for unit in units:
            unit.enter(self._cursor)  # nested users keep it gathered
            self._cursor += 1
            self._unshard(unit)
            if not self._order_recorded:
                self._trace.append(unit)
                if unit not in self._forward_order:
                    self._forward_order.append(unit)
        if units and self._order_recorded:
            self._prefetch(units[-1], step=1)

    def _prefetch(self, unit: Stage3Unit, *, step: int) -> None:
        """Start gathering the units that ran after (``step=1``, forward) or before
        (``step=-1``, backward) ``unit`` on the recorded first step, up to
        ``prefetch_numel`` elements. See [Note: prefetch]."""
        order = self._forward_order
        if unit not in order:
            return
        budget, i = self.prefetch_numel, order.index(unit) + step
        while 0 <= i < len(order) and budget >= order[i].padded:
            if order[i].state is not UnitState.SHARDED:
                i += step  # already whole (kept for reuse, persistent, or in flight)
                continue
            if self.live_numel + order[i].padded > self.max_live_numel:
                return  # stage3_max_live_parameters
            if self._needs_read(order[i]) and len(self._holding) >= self.param_offload.buffer_count:
                return  # offload_param.buffer_count: no free read buffer
            budget -= order[i].padded
            self._start_unshard(order[i])
            i += step

    def _post_forward(self, module: nn.Module, args, output):
        units = self._units_of.get(module, ())
        if self._is_root_module(module):
            return output
        for unit in units:
            position = unit.exit()
            if unit.active == 0 and not self._keep_for_reuse(position):
                self._reshard(unit)
        if torch.is_grad_enabled():
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._pre_backward_hook(units))
        return output

    def _keep_for_reuse(self, position: int) -> bool:
        """Whether the unit of the call at trace ``position`` stays whole after its forward:
        it is used again (a second call, or its backward) within
        ``stage3_max_reuse_distance`` elements of other gathers on the recorded trace, and
        keeping it stays within ``stage3_max_live_parameters``."""
        if not self._order_recorded or not torch.is_grad_enabled():
            return False
        if position >= len(self._reuse_distance):
            return False  # this step runs more calls than the recorded one
        return self._reuse_distance[position] <= self.max_reuse_distance and \
            self.live_numel <= self.max_live_numel

    def _plan_reuse(self) -> None:
        """For each forward call on the trace, the elements gathered before its unit is used
        again: forward calls after it, then backward (the trace in reverse) back to it."""
        sequence = self._trace + self._trace[::-1]
        self._reuse_distance = []
        for i, unit in enumerate(self._trace):
            between = 0
            for other in sequence[i + 1:]:
                if other is unit:
                    break
                between += other.padded
            self._reuse_distance.append(between)

    def _is_root_module(self, module: nn.Module) -> bool:
        return module is self.module

    def _pre_backward_hook(self, units):
        def hook(grad):
            for unit in units:
                self._unshard(unit)
            if units and self._order_recorded:
                self._prefetch(units[0], step=-1)
            return grad
        return hook

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        super()._on_grad_ready(param)
        unit = self._bucket_of[param]
        if len(unit.ready) == len(unit.params):
            self._reshard(unit)

    def finalize_backward(self) -> None:
        super().finalize_backward()
        if not self._order_recorded and self._forward_order:
            self._order_recorded = True
            self._plan_reuse()
        self._cursor = 0
        for unit in self.buckets:
            # a prefetch still in flight would read the shard the optimizer is about to change
            if not self._keeping and unit.state is not UnitState.SHARDED:
                self._reshard(unit, force=True)
            unit.forget_calls()

    # -- step and state -------------------------------------------------------------------------

    def sync_params_from_master(self) -> None:
        """Gather the persistent units from their updated shards; the others are gathered
        from the shards when used."""
        handles = []
        with torch.no_grad():
            for unit in self.buckets:
                if unit.persistent:
                    shard = to_device(unit.master.detach(), unit.flat_param.device, unit.flat_param.dtype)
                    handles.append(self.comm.all_gather_into_tensor(
                        unit.flat_param, shard, tag=f"persistent parameters (unit {unit.index})"))
        for handle in handles:
            handle.wait()

    def reset_master_from_params(self) -> None:
        """Masters are loaded with the module state (``load_module_state_dict``)."""

    def _copy_masters_to_params(self, buckets) -> None:
        """Nothing to copy: units are gathered from the masters when used."""

    def _gather_params(self) -> None:
        self.sync_params_from_master()

    def module_state_dict(self) -> dict:
        """The full module state (collective: every unit is gathered, copied, released)."""
        self._ensure_layout()
        for unit in self.buckets:
            self._unshard(unit)
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        for unit in self.buckets:
            self._reshard(unit, force=True)
        return state

    def module_state_pieces(self):
        """The state dict a unit at a time: first what no unit holds, then each unit's
        parameters under every key that names them (tied ones twice), gathered for the
        piece and released after it. Collective: every rank must take every piece."""
        self._ensure_layout()
        current = self.module.state_dict(keep_vars=True)
        keys_of: dict[int, list[str]] = {}
        for key, tensor in current.items():
            keys_of.setdefault(id(tensor), []).append(key)
        yield {k: v.detach() for k, v in current.items() if v not in self._bucket_of}
        for unit in self.buckets:
            was_gathered = unit.state is UnitState.GATHERED
            self._unshard(unit)
            yield {key: p.detach() for p in unit.params for key in keys_of.get(id(p), [])}
            if not was_gathered:
                self._reshard(unit, force=True)

    @contextlib.contextmanager
    def module_shards(self, bucket: int):
        """This rank's shard of a unit's parameters in their training dtype, from its fp32
        shard (read from its swap file when there)."""
        unit = self.buckets[bucket]
        if self.swapper is not None and self.swapper.master_swapped(unit.index):
            shard = self.swapper.read_master(unit.index).result()
        else:
            shard = unit.master.detach()
        yield {PARAM_KEY: shard.to(unit.flat_param.dtype)}

    def load_module_state_dict(self, state: dict, *, strict: bool):
        """Load full weights into the shards a unit at a time: each rank copies out of the
        (possibly mapped) full tensors only its shard, so nothing is gathered. Keys are
        checked as ``nn.Module.load_state_dict`` checks them."""
        self._ensure_layout()
        current = self.module.state_dict(keep_vars=True)
        key_of: dict[int, str] = {}  # a unit parameter -> a key that holds it (tied: the first given)
        for key, tensor in current.items():
            if tensor in self._bucket_of and key in state and id(tensor) not in key_of:
                key_of[id(tensor)] = key
        mismatched = [f"size mismatch for {key}: copying a param with shape {tuple(state[key].shape)} from "
                      f"checkpoint, the shape in current model is {tuple(tensor.ds_shape)}"
                      for key, tensor in current.items()
                      if tensor in self._bucket_of and key in state and state[key].shape != tensor.ds_shape]
        if mismatched:
            raise RuntimeError("Error(s) in loading state_dict: " + "; ".join(mismatched))
        rest = {k: v for k, v in state.items() if not (k in current and current[k] in self._bucket_of)}
        result = self.module.load_state_dict(rest, strict=False)
        missing = [k for k in result.missing_keys if k not in state]
        unexpected = list(result.unexpected_keys)
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict: missing keys {missing}, unexpected keys "
                               f"{unexpected}; load with load_module_strict=False to skip them")
        with torch.no_grad():
            for unit in self.buckets:
                present = [key_of.get(id(p)) for p in unit.params]
                if not any(present):
                    continue
                if unit.state is UnitState.GATHERED and not unit.persistent:
                    self._reshard(unit, force=True)
                with self._resident([unit]):
                    if all(present):
                        unit.master.copy_(self._local_slice(unit, [state[k] for k in present], torch.float32))
                    else:  # some of the unit's parameters keep their values: gather, fill, cut
                        self._unshard(unit)
                        for p, key in zip(unit.params, present):
                            if key is not None:
                                p.copy_(state[key])
                        unit.master.copy_(unit.local(unit.flat_param, self.comm.rank))
                        self._reshard(unit, force=True)
        self.sync_params_from_master()  # persistent units are whole: refresh them
        return result._replace(missing_keys=missing, unexpected_keys=unexpected)

    def model_state_bytes(self) -> ModelStateBytes:
        live = sum(u.flat_param.untyped_storage().nbytes() for u in self.buckets)
        masters = sum(u.master.numel() * 4 for u in self.buckets)
        mixed = self.policy.needs_master_copy
        grads = sum(u.grad_shard.numel() * 4 for u in self.buckets)
        return ModelStateBytes(live + (0 if mixed else masters), grads, masters if mixed else 0,
                               optimizer_state_bytes(self.optimizer))

    def add_external_user(self, module: nn.Module, unit: Stage3Unit) -> None:
        """Gather ``unit`` for ``module``'s forward and backward too (its owner is elsewhere)."""
        if module not in self._units_of:
            self._units_of[module] = []
            module.register_forward_pre_hook(self._pre_forward)
            module.register_forward_hook(self._post_forward)
        if unit not in self._units_of[module]:
            self._units_of[module].append(unit)

    @contextlib.contextmanager
    def keep_gathered(self):
        """Keep every unit whole from its first gather until the block ends, then free them
        all (before the optimizer step changes the shards): a pipeline stage runs many
        micro-batches through the same layers in one batch, and each would otherwise
        gather every unit twice (forward and backward). Costs the units' full parameters
        for the block, over ``stage3_max_live_parameters`` if need be."""
        self._keeping = True
        try:
            yield
        finally:
            self._keeping = False
            self.release_gathered()

    def release_gathered(self) -> None:
        """Free every non-persistent unit still gathered (e.g. by evaluation outside the
        engine's step)."""
        for unit in self.buckets:
            if not unit.persistent and unit.state is not UnitState.SHARDED:
                self._reshard(unit, force=True)

    def gather_units(self, units) -> None:
        """Gather the given units (collective); see ``GatheredParameters``."""
        for unit in units:
            self._unshard(unit)

    def release_units(self, units, *, modifier_rank: int | None) -> None:
        """Take modifications from ``modifier_rank`` (if any) into the shards, then free."""
        with torch.no_grad():
            for unit in units:
                if modifier_rank is not None:
                    self.comm.broadcast(unit.flat_param, src=modifier_rank, tag="GatheredParameters").wait()
                    with self._resident([unit]):
                        unit.master.copy_(unit.local(unit.flat_param, self.comm.rank))
                self._reshard(unit, force=not self._keeping)
