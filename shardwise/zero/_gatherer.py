"""When parameters are whole and where their shards live: the object a sharded strategy
holds for it, instead of a subclass overriding its steps.

:class:`BucketGatherer` (stages 1 and 2) keeps every parameter whole and all-gathers every
bucket after the step. :class:`UnitGatherer` (stage 3) owns everything between a unit's
shard and its full parameters: the forward and backward hooks that gather and free units,
prefetch, reuse, the ``keep_gathered`` block and reading shards from swap files. The
strategy lays buckets out, reduces gradients and steps; it tells its gatherer when a
gradient is staged (``grad_ready``), when a backward is over (``backward_done``) and when
the masters changed (``copy_masters_to_params``, ``gather_params``). Unit states and
their transitions are in ``_unit.py`` ([Note: unit states]).

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
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from shardwise.offload import copy_from_host_, to_device
from shardwise.zero._bucket import ShardedBucket, master_is_copy
from shardwise.zero._unit import Stage3Unit, UnitState


class BucketGatherer:
    """How stages 1 and 2 hold parameters, for the strategy that holds this: whole on
    every rank. Nothing happens around forward and backward; after the step each rank
    writes its updated shard into its slice of the parameters and every bucket is
    all-gathered. Stage 3's counterpart is :class:`UnitGatherer`."""

    def __init__(self, strategy):
        self.strategy = strategy

    def offloads(self) -> bool:
        """Whether masters, gradient shards and optimizer state live in CPU memory."""
        return self.strategy.offload is not None

    def swap_masters(self) -> bool:
        """Whether the nvme tier swaps the masters' values too: here, when they are copies
        (a master that is the parameters' own storage must stay for the forward)."""
        return any(master_is_copy(b) for b in self.strategy.buckets)

    def pinned_masters(self) -> frozenset[int]:
        """Buckets whose masters never go to swap files."""
        return frozenset()

    def param_shard(self, bucket: ShardedBucket) -> torch.Tensor:
        """This rank's shard of ``bucket``'s parameters in their training dtype: its slice
        of the whole parameters."""
        return bucket.local(bucket.flat_param, bucket.comm.rank)

    def grad_ready(self, param: nn.Parameter) -> None:
        """Nothing: the parameters stay whole."""

    def backward_done(self) -> None:
        """Nothing: the parameters stay whole."""

    def copy_masters_to_params(self, buckets: list[ShardedBucket]) -> None:
        """Write updated masters into this rank's slice of the parameters (when they are copies)."""
        with torch.no_grad():
            for bucket in buckets:
                if master_is_copy(bucket):
                    copy_from_host_(bucket.local(bucket.flat_param, bucket.comm.rank), bucket.master)

    def gather_params(self) -> None:
        """All-gather every bucket from each rank's slice."""
        handles = [
            bucket.comm.all_gather_scratch(bucket.flat_param, tag=f"parameter bucket {bucket.index}")
            for bucket in self.strategy.buckets
        ]
        for handle in handles:
            handle.wait()

    def sync_params_from_master(self) -> None:
        """Write each rank's updated shard into place and all-gather every bucket."""
        for bucket in self.strategy.buckets:
            with self.strategy._resident([bucket]):
                self.copy_masters_to_params([bucket])
        self.gather_params()

    def reset_master_from_params(self) -> None:
        """Copy this rank's slice of the parameters into the masters that are copies."""
        with torch.no_grad():
            for bucket in self.strategy.buckets:
                with self.strategy._resident([bucket]):
                    if master_is_copy(bucket):
                        bucket.master.copy_(bucket.local(bucket.flat_param, bucket.comm.rank))

    def release_gathered(self) -> None:
        """Parameters are whole by design at stages 1 and 2: nothing to release."""


class UnitGatherer:
    """Gathers and frees the units of one stage-3 strategy (see the module docstring).

    Args:
        strategy: the strategy whose units these are; the gatherer reads its root
            ``module``, ``comm``, ``timer``, ``swapper`` (nvme tier), ``buckets`` and
            ``offload``, and asks it to lay units out (``_ensure_layout``).
        param_offload: ``zero_optimization.offload_param`` (None: off).
        prefetch_numel: ``stage3_prefetch_bucket_size``.
        max_live_numel: ``stage3_max_live_parameters``.
        max_reuse_distance: ``stage3_max_reuse_distance``.
    """

    def __init__(self, strategy, *, param_offload, prefetch_numel: int, max_live_numel: int, max_reuse_distance: int):
        self.strategy = strategy
        self.param_offload = param_offload
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.live_numel = 0
        """Elements of the non-persistent units gathered (or being gathered) right now."""
        self.peak_live_numel = 0
        """The most ``live_numel`` has been since construction (tests bound it)."""
        self.peak_param_buffers = 0
        """The most read buffers held at once (tests bound it by offload_param.buffer_count)."""
        self._forward_order: list[Stage3Unit] = []
        self._trace: list[Stage3Unit] = []
        """Units in the order the first step's forward gathered them, repeats included."""
        self._reuse_distance: list[float] = []
        self._cursor = 0
        self._order_recorded = False
        self._keeping = False
        """Inside ``keep_gathered``: units stay whole until it ends."""
        self._units_of: dict[nn.Module, list[Stage3Unit]] = {}
        self._in_forward: list[nn.Module] = []
        """The hooked modules whose forward is running, innermost last (see [Note: reading
        a sharded parameter])."""
        self._reading: collections.deque[Stage3Unit] = collections.deque()
        """Units whose shards are being read from swap files, in the order the reads began."""
        self._holding: collections.deque[Stage3Unit] = collections.deque()
        """Units holding a parameter read buffer (read or all-gather not complete), oldest first."""

    # -- users of a unit ----------------------------------------------------------------------

    def add_user(self, module: nn.Module, unit: Stage3Unit) -> None:
        """Gather ``unit`` for ``module``'s forward and backward (its owner, or a module
        declared with ``register_external_parameter``)."""
        if module not in self._units_of:
            self._units_of[module] = []
            module.register_forward_pre_hook(self._pre_forward)
            module.register_forward_hook(self._post_forward)
        if unit not in self._units_of[module]:
            self._units_of[module].append(unit)

    def watch(self, root: nn.Module) -> None:
        """Hook ``root``'s forward even if it owns no unit, so that a parameter read in its
        own code (outside every user's forward) has a module to be gathered for."""
        if root not in self._units_of:
            self._units_of[root] = []
            root.register_forward_pre_hook(self._pre_forward)
            root.register_forward_hook(self._post_forward)

    def gather_for_read(self, unit: Stage3Unit) -> None:
        """A parameter of ``unit`` is read while it is not gathered: during a forward, gather
        it and make the innermost running module one of its users. See [Note: reading a
        sharded parameter]."""
        if unit.state is UnitState.GATHERED or not self._in_forward or self._in_forward[0] is not self.strategy.module:
            return  # whole already, or no forward of the model running
        module = self._in_forward[-1]
        self.add_user(module, unit)
        self._enter(unit)  # as the module's pre-forward will from now on

    def add_sharer(self, module: nn.Module, unit: Stage3Unit) -> None:
        """``module`` uses a parameter of the root ``unit`` (a tied weight): gather the unit
        when ``module`` is called on its own."""
        module.register_forward_pre_hook(lambda module, args, unit=unit: self.unshard(unit))

    # -- gather and free ----------------------------------------------------------------------

    def count_live(self, unit: Stage3Unit, sign: int) -> None:
        """Count ``unit``'s elements in (+1) or out (-1) of the live parameters."""
        if not unit.persistent:
            self.live_numel += sign * unit.padded
            self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def unshard(self, unit: Stage3Unit) -> None:
        """Make ``unit`` GATHERED (collective unless it already is)."""
        if unit.state is UnitState.GATHERED:
            return
        self._start_unshard(unit)
        self._finish_gather(unit)

    def reshard(self, unit: Stage3Unit, *, force: bool = False) -> None:
        """Free ``unit`` unless it is persistent or sharded already; unless ``force``, the
        root unit and units inside ``keep_gathered`` stay."""
        if unit.persistent or unit.state is UnitState.SHARDED:
            return  # persistent units stay whole; a sharded unit has nothing to free
        if not force and (unit.module is self.strategy.module or self._keeping):
            return  # tied / shared parameters stay gathered until backward ends; see keep_gathered
        if unit.state is UnitState.READING:  # a prefetched read nobody used: no collective
            self._reading.remove(unit)
        self._release_buffer(unit)
        unit.free()  # a prefetched all-gather nobody used is waited for
        self.count_live(unit, -1)

    def _start_unshard(self, unit: Stage3Unit) -> None:
        """Allocate the unit's full buffer and launch its all-gather (see [Note: prefetch]).
        A shard in a swap file (offload_param nvme) is read first: see [Note: gathering
        swapped shards]."""
        if unit.state is not UnitState.SHARDED:
            return
        self.count_live(unit, +1)
        if self._needs_read(unit):
            while len(self._holding) >= self.param_offload.buffer_count:
                self._finish_gather(self._holding[0])  # free the oldest buffer
            unit.begin_read(self.strategy.swapper.read_master(unit.index))
            self._reading.append(unit)
            self._holding.append(unit)
            self.peak_param_buffers = max(self.peak_param_buffers, len(self._holding))
            return
        self._launch_gather(unit, unit.master.detach())

    def _needs_read(self, unit: Stage3Unit) -> bool:
        """Whether gathering ``unit`` starts with reading its shard from a swap file."""
        swapper = self.strategy.swapper
        return swapper is not None and swapper.master_swapped(unit.index)

    def _finish_gather(self, unit: Stage3Unit) -> None:
        """Complete ``unit``'s read (launching the gathers read before it) and all-gather,
        and point its parameters at the full buffer."""
        with self.strategy.timer("gather_params"):
            if unit.state is UnitState.READING:
                self._gather_read(unit)
            unit.finish_gather()
        self._release_buffer(unit)

    def _release_buffer(self, unit: Stage3Unit) -> None:
        if unit in self._holding:
            self._holding.remove(unit)

    def _launch_gather(self, unit: Stage3Unit, shard: torch.Tensor) -> None:
        comm, tag = unit.comm, f"parameters of unit {unit.index} ({type(unit.module).__name__})"
        unit.begin_gather(
            lambda flat: comm.all_gather_into_tensor(flat, to_device(shard, flat.device, flat.dtype), tag=tag)
        )

    def _gather_read(self, upto: Stage3Unit) -> None:
        """Launch the all-gathers of units whose shards were being read, in the order the
        reads started, up to ``upto``. See [Note: gathering swapped shards]."""
        while self._reading:
            unit = self._reading.popleft()
            self._launch_gather(unit, unit.take_read())
            if unit is upto:
                return

    # -- hooks ------------------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args) -> None:
        self.strategy._ensure_layout()
        if module is self.strategy.module:
            self._cursor = 0  # a new forward
            self._in_forward.clear()
        self._in_forward.append(module)
        units = self._units_of.get(module, ())
        for unit in units:
            self._enter(unit)
        if units and self._order_recorded:
            self._prefetch(units[-1], step=1)

    def _enter(self, unit: Stage3Unit) -> None:
        """A user's forward call of ``unit`` begins at the next trace position: gather it."""
        unit.enter(self._cursor)  # nested users keep it gathered
        self._cursor += 1
        self.unshard(unit)
        if not self._order_recorded:
            self._trace.append(unit)
            if unit not in self._forward_order:
                self._forward_order.append(unit)

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
        if self._in_forward and self._in_forward[-1] is module:
            self._in_forward.pop()
        if module is self.strategy.module:
            # a forward that raised, or a checkpoint's recompute stopped early, never popped
            self._in_forward.clear()
            # the root's units (its shared parameters, those it reads from other modules) stay
            # gathered until the end of backward; with no backward coming they are freed now
            for unit in units:
                unit.exit()
                if unit.active == 0 and not torch.is_grad_enabled():
                    self.reshard(unit, force=not self._keeping)
            return output
        for unit in units:
            position = unit.exit()
            if unit.active == 0 and not self._keep_for_reuse(position):
                self.reshard(unit)
        if torch.is_grad_enabled():
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._pre_backward_hook(units))
            self._post_backward_hook([u for u in units if u.frozen], args)
        return output

    def _post_backward_hook(self, frozen: list[Stage3Unit], args) -> None:
        """Free the frozen ``units`` once the gradients of the module's ``args`` are computed:
        the module's backward is then done with them (they have no gradient of their own
        to say so). Without such inputs no backward runs through them but the one that ends
        at ``backward_done``. See [Note: frozen units] in ``_stage3.py``."""
        inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not frozen or not inputs:
            return

        def hook(grads):
            for unit in frozen:
                if unit.active == 0:
                    self.reshard(unit)

        torch.autograd.graph.register_multi_grad_hook(inputs, hook)

    def _keep_for_reuse(self, position: int) -> bool:
        """Whether the unit of the call at trace ``position`` stays whole after its forward:
        it is used again (a second call, or its backward) within
        ``stage3_max_reuse_distance`` elements of other gathers on the recorded trace, and
        keeping it stays within ``stage3_max_live_parameters``."""
        if not self._order_recorded or not torch.is_grad_enabled():
            return False
        if position >= len(self._reuse_distance):
            return False  # this step runs more calls than the recorded one
        return self._reuse_distance[position] <= self.max_reuse_distance and self.live_numel <= self.max_live_numel

    def _plan_reuse(self) -> None:
        """For each forward call on the trace, the elements gathered before its unit is used
        again: forward calls after it, then backward (the trace in reverse) back to it."""
        sequence = self._trace + self._trace[::-1]
        self._reuse_distance = []
        for i, unit in enumerate(self._trace):
            between = 0
            for other in sequence[i + 1 :]:
                if other is unit:
                    break
                between += other.padded
            self._reuse_distance.append(between)

    def _pre_backward_hook(self, units):
        """A hook for each output of a call of the units' module: autograd runs it just before
        the node that made that output, so every call's backward gathers again what an
        earlier-run call's backward may have freed (a module called in two branches;
        tests/dist/zero/test_stage3_reused_modules.py)."""

        def hook(grad):
            for unit in units:
                self.unshard(unit)
            if units and self._order_recorded:
                self._prefetch(units[0], step=-1)
            return grad

        return hook

    # -- the strategy's backward and step -------------------------------------------------------

    def grad_ready(self, param: nn.Parameter) -> None:
        """After ``param``'s gradient hook: free its unit once all the unit's gradients are
        staged for reduction."""
        unit = self.strategy.unit_of(param)
        if len(unit.ready) == len(unit.params):
            self.reshard(unit)

    def backward_done(self) -> None:
        """After a backward: the first one fixes the recorded order; every unit is freed
        (a prefetch still in flight would read the shard the optimizer is about to
        change) unless inside ``keep_gathered``."""
        if not self._order_recorded and self._forward_order:
            self._order_recorded = True
            self._plan_reuse()
        self._cursor = 0
        for unit in self.strategy.buckets:
            if not self._keeping and unit.state is not UnitState.SHARDED:
                self.reshard(unit, force=True)
            unit.forget_calls()

    @contextlib.contextmanager
    def keep_gathered(self):
        """Keep every unit whole from its first gather until the block ends, then free them
        all. See ``Stage3Strategy.keep_gathered``."""
        self._keeping = True
        try:
            yield
        finally:
            self._keeping = False
            self.release_gathered()

    @property
    def keeping(self) -> bool:
        """Inside ``keep_gathered``."""
        return self._keeping

    def release_gathered(self) -> None:
        """Free every non-persistent unit still gathered or in flight."""
        for unit in self.strategy.buckets:
            if not unit.persistent and unit.state is not UnitState.SHARDED:
                self.reshard(unit, force=True)

    # -- where the shards live, and the step ------------------------------------------------------

    def offloads(self) -> bool:
        """Offloading parameters or the optimizer puts the fp32 shards in CPU memory."""
        return self.strategy.offload is not None or self.param_offload is not None

    def swap_masters(self) -> bool:
        """The masters are the parameter shards: swapped only with offload_param nvme."""
        return self.param_offload is not None and self.param_offload.device == "nvme"

    def pinned_masters(self) -> frozenset[int]:
        """Persistent units, then the first units up to offload_param.max_in_cpu elements."""
        pinned, budget = set(), self.param_offload.max_in_cpu if self.param_offload is not None else 0
        for unit in self.strategy.buckets:
            if unit.persistent:
                pinned.add(unit.index)
            elif unit.master.numel() <= budget:
                budget -= unit.master.numel()
                pinned.add(unit.index)
        return frozenset(pinned)

    def param_shard(self, unit: Stage3Unit) -> torch.Tensor:
        """This rank's shard of ``unit``'s parameters in their training dtype, from its fp32
        master (read from its swap file when there)."""
        swapper = self.strategy.swapper
        if swapper is not None and swapper.master_swapped(unit.index):
            shard = swapper.read_master(unit.index).result()
        else:
            shard = unit.master.detach()
        return shard.to(unit.flat_param.dtype)

    def copy_masters_to_params(self, units) -> None:
        """Nothing to copy: units are gathered from the masters when used."""

    def reset_master_from_params(self) -> None:
        """Masters are loaded with the module state (``load_module_state_dict``)."""

    def sync_params_from_master(self) -> None:
        """Gather the persistent units from their updated shards; the others are gathered
        from the shards when used."""
        strategy, handles = self.strategy, []
        with torch.no_grad():
            for unit in strategy.buckets:
                if unit.persistent:
                    shard = to_device(unit.master.detach(), unit.flat_param.device, unit.flat_param.dtype)
                    handles.append(
                        unit.comm.all_gather_into_tensor(
                            unit.flat_param, shard, tag=f"persistent parameters (unit {unit.index})"
                        )
                    )
        for handle in handles:
            handle.wait()

    def gather_params(self) -> None:
        """After the step: only the persistent units are whole, and gathered again."""
        self.sync_params_from_master()
