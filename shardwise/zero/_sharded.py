"""ZeRO stages 1 and 2: each rank keeps 1/N of the optimizer state (1) and of the
gradients as well (2); parameters stay whole on every rank.

Layout: see [Note: bucket partition rule] in ``_partition.py``. Module parameters are
views into their bucket's flat parameter buffer, so a rank's shard of the parameters is a
slice of it; the optimizer updates one fp32 tensor per bucket shard (that slice itself in
fp32 training, a separate master copy under fp16/bf16), and after the step every bucket
is all-gathered back into place.

Gradients: stage 1 accumulates full gradients (``.grad`` are views into a flat buffer, as
stage 0) and reduce-scatters each bucket on the accumulation boundary. Stage 2 never
keeps full gradients: on every micro-step each gradient is copied into its bucket's
short-lived staging buffer as soon as autograd produces it, the bucket is
reduce-scattered when complete, and this rank's slice is added to a persistent fp32
gradient shard; at most ``_MAX_IN_FLIGHT`` staging buffers are alive at once.
Buckets launch in one fixed order on every rank (see [Note: bucket launch order] in
``_stage0.py``).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import weakref

import torch
from torch import nn

from shardwise.comm import Communicator
from shardwise.offload import HostCopies
from shardwise.precision import PrecisionPolicy
from shardwise.zero._bucket import ShardedBucket, same_storage
from shardwise.zero._gatherer import BucketGatherer
from shardwise.zero._partition import partition
from shardwise.zero._stage0 import broadcast_module_state
from shardwise.zero._strategy import (
    ModelParallel,
    StepResult,
    clip_by_total_norm_,
    no_timer,
)
from shardwise.zero._views import ShardedViews

_MAX_IN_FLIGHT = 2


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's ``defaults`` that its constructor takes (torch's AdamW records
    ``decoupled_weight_decay`` there but does not accept it)."""
    accepted = inspect.signature(type(optimizer)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


class ShardedStrategy:
    """ZeRO stage 1 or 2 (see the module docstring for what each keeps).

    Args:
        module: the model; its parameters become views into flat bucket buffers.
        comm: the data-parallel communicator.
        policy: parameter and master dtypes.
        stage: 1 or 2.
        bucket_numel: elements per bucket (reduce-scatter and all-gather unit).
        predivide_factor: divide gradients by this before the reduction (1.0: after).
        offload: ``zero_optimization.offload_optimizer``; None or device "none" keeps the
            optimizer state with the model. See ``_master_device`` and [Note: optimizer
            swapping] in ``offload/_optimizer.py``.
        aio: the ``aio`` config (swap-file I/O), for offload to nvme.
        sub_group_size: elements stepped at once when offloading to nvme.
        expert_comms: expert parameters -> the communicator of the ranks holding the same
            experts; their buckets are sharded and reduced there (see [Note: expert groups]
            in ``parallel/_expert.py``), every other bucket over ``comm``.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        comm: Communicator,
        policy: PrecisionPolicy,
        stage: int,
        bucket_numel: int,
        predivide_factor: float = 1.0,
        offload=None,
        aio=None,
        sub_group_size: int = 1_000_000_000,
        model_parallel: ModelParallel = ModelParallel(),
        expert_comms: dict | None = None,
    ):
        self.module, self.comm, self.policy, self.stage = module, comm, policy, stage
        self.expert_comms = expert_comms or {}
        self.model_parallel = model_parallel
        self.bucket_numel, self.predivide_factor = bucket_numel, predivide_factor
        self.offload = offload if offload is not None and offload.enabled else None
        self.aio, self.sub_group_size = aio, sub_group_size
        self.swapper = None
        """The nvme tier's :class:`~shardwise.offload.OptimizerSwapper` (None otherwise)."""
        self.timer = no_timer
        self.gatherer = BucketGatherer(self)
        """When parameters are gathered and where the shards live (stage 3 holds a
        ``UnitGatherer`` instead)."""
        self.views = ShardedViews(self)
        """The state and checkpoint views (``ZeroViews``; stage 3 holds ``Stage3Views``)."""
        self.optimizer: torch.optim.Optimizer | None = None
        module.to(policy.param_dtype)
        broadcast_module_state(module, comm, self.expert_comms)
        self.trainable = [p for p in module.parameters() if p.requires_grad]
        self.names = {p: n for n, p in module.named_parameters()}
        self.buckets: list[ShardedBucket] = []
        self._bucket_of: dict[nn.Parameter, ShardedBucket] = {}
        self._offset_of: dict[nn.Parameter, int] = {}
        self._group_options: list[dict] = []
        self._reducing = False
        self.accumulate_unreduced = False
        """Let a micro-step skip the reduction at stage 2 and 3 (``sync=False``): the full
        gradients then accumulate on the parameters until the boundary's reduction, which
        costs them in memory (as at stage 1); the pipeline engine does this."""
        self._next_launch = 0
        self._in_flight: collections.deque[ShardedBucket] = collections.deque()
        self._host_copies = None
        """Device-to-host gradient copies (``offload.HostCopies``), made on first use."""
        self._to_host: collections.deque[tuple] = collections.deque()
        """Gradient copies to the CPU in flight: (bucket, pending copy, accumulate)."""
        for p in self.trainable:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            p._shardwise_strategy = weakref.ref(self)

    # -- layout ---------------------------------------------------------------------------

    def without_optimizer(self, params: list) -> None:
        """An engine with no optimizer: parameters stay whole at stages 1 and 2."""

    def optimizer_params(self, model_parameters) -> list[dict]:
        """Lay out buckets for the user's parameter groups; returns groups of bucket shards."""
        if self.buckets:
            raise RuntimeError("ZeRO buckets are already laid out; build one optimizer per engine")
        items = list(model_parameters)
        groups = items if items and isinstance(items[0], dict) else [{"params": items}]
        order = {p: i for i, p in enumerate(self.trainable)}
        seen: set[nn.Parameter] = set()
        for group in groups:
            params = [p for p in group["params"] if p in order and p not in seen]
            seen.update(params)
            self._group_options.append({k: v for k, v in group.items() if k != "params"})
            self._layout(sorted(params, key=order.get, reverse=True), len(self._group_options) - 1)
        rest = [p for p in self.trainable if p not in seen]
        if rest:  # trainable but not optimized: still reduced, never updated
            self._layout(list(reversed(rest)), group=-1)
        return [
            {**options, "params": [b.master for b in self.buckets if b.group == g]}
            for g, options in enumerate(self._group_options)
        ]

    def _layout(self, params: list[nn.Parameter], group: int) -> None:
        pending: list[nn.Parameter] = []
        for p in params:
            if pending and (
                sum(q.numel() for q in pending) + p.numel() > self.bucket_numel
                or pending[0].dtype != p.dtype
                or self._comm_of(pending[0]) is not self._comm_of(p)
            ):
                self._add_bucket(pending, group)
                pending = []
            pending.append(p)
        if pending:
            self._add_bucket(pending, group)

    def _comm_of(self, param: nn.Parameter) -> Communicator:
        """The ranks ``param``'s bucket is sharded over (its expert-data-parallel group for
        an expert parameter)."""
        return self.expert_comms.get(param, self.comm)

    def _master_device(self, device: torch.device) -> torch.device:
        """Where masters, gradient shards and optimizer state live: the CPU when offloaded."""
        return torch.device("cpu") if self.gatherer.offloads() else device

    def _host_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-locked when offload asks for pin_memory and there is a GPU to copy to."""
        if self.offload is not None and self.offload.pin_memory and torch.cuda.is_available():
            return tensor.pin_memory()
        return tensor

    def _add_bucket(self, params: list[nn.Parameter], group: int) -> None:
        comm = self._comm_of(params[0])
        rank, dtype, device = comm.rank, params[0].dtype, params[0].device
        host = self._master_device(device)
        offsets, numel = [], 0
        for p in params:
            offsets.append(numel)
            numel += p.numel()
        padded, shard = partition(numel, comm.world_size)
        flat = torch.zeros(padded, dtype=dtype, device=device)
        with torch.no_grad():
            for p, off in zip(params, offsets):
                flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = flat[off : off + p.numel()].view_as(p)
        bucket = ShardedBucket(
            len(self.buckets),
            group,
            params,
            offsets,
            numel,
            padded,
            shard,
            flat,
            shapes=[p.shape for p in params],
            comm=comm,
        )
        local = bucket.local(flat, rank)
        separate = self.policy.needs_master_copy or host != device
        bucket.master = nn.Parameter(
            self._host_tensor(local.detach().to(host, torch.float32, copy=True)) if separate else local
        )
        if self.stage == 1:
            bucket.grad_full = torch.zeros(padded, dtype=dtype, device=device)
            local_grad = bucket.local(bucket.grad_full, rank)
            bucket.grad_shard = (
                local_grad
                if local_grad.dtype == torch.float32 and host == device
                else self._new_grad_shard(shard, host)
            )
        else:
            bucket.grad_shard = self._new_grad_shard(shard, host)
        bucket.master.grad = bucket.grad_shard
        self.buckets.append(bucket)
        self._bucket_of.update(dict.fromkeys(params, bucket))
        self._offset_of.update(zip(params, offsets))

    def _new_grad_shard(self, numel: int, device: torch.device) -> torch.Tensor:
        """An fp32 gradient shard, left unwritten until the first backward or step zeroes it
        (``_zero_new_grads``): a large fresh allocation is not resident until touched, so
        while the model is laid out (and, with nvme offload, before the masters have gone
        to their swap files) the shards cost no memory."""
        self._grads_unwritten = True
        return self._host_tensor(torch.empty(numel, dtype=torch.float32, device=device))

    def _zero_new_grads(self) -> None:
        if getattr(self, "_grads_unwritten", False):
            self._grads_unwritten = False
            for bucket in self.buckets:
                if bucket.grad_shard is not None:
                    bucket.grad_shard.zero_()

    def adopt_client_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Use ``optimizer``; one built over the original parameters is rebuilt over shards."""
        from shardwise.optim.onebit import refuse_with_zero

        refuse_with_zero(optimizer, self.stage)
        shards = {id(b.master) for b in self.buckets}
        if not all(id(p) in shards for g in optimizer.param_groups for p in g["params"]):
            if optimizer.state:
                raise ValueError(
                    "a client optimizer that already holds state cannot be sharded by "
                    "ZeRO; pass it before its first step"
                )
            groups = [dict(g) for g in optimizer.param_groups]
            optimizer = type(optimizer)(self.optimizer_params(groups), **_constructor_defaults(optimizer))
        self.optimizer = optimizer
        if self.offload is not None and self.offload.device == "nvme":
            from shardwise.offload import build_optimizer_swapper

            self._ensure_layout()
            self.swapper = build_optimizer_swapper(
                optimizer,
                [b.master for b in self.buckets],
                comm=self.comm,
                nvme_path=self.offload.nvme_path,
                aio=self.aio,
                sub_group_size=self.sub_group_size,
                buffer_count=self.offload.buffer_count,
                swap_masters=self.gatherer.swap_masters(),
                pinned=self.gatherer.pinned_masters(),
            )
        return optimizer

    def _ensure_layout(self) -> None:
        if not self.buckets:
            self.optimizer_params(self.trainable)

    # -- backward ---------------------------------------------------------------------------

    def pre_backward(self, *, boundary: bool, sync: bool) -> None:
        self._ensure_layout()
        self._zero_new_grads()
        if self.stage >= 2 and not sync and not self.accumulate_unreduced:
            raise RuntimeError(
                f"no_sync() cannot be used with ZeRO stage {self.stage}: gradients are "
                "reduced on every micro-step; use stage 0 or 1"
            )
        if self.stage == 1:
            self._attach_grad_views()
        self._reducing = sync and (boundary or self.stage >= 2)
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.ready.clear()

    def _attach_grad_views(self) -> None:
        for bucket in self.buckets:
            for p, off in zip(bucket.params, bucket.offsets):
                view = bucket.grad_full[off : off + p.numel()].view_as(p)
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                else:
                    continue
                p.grad = view

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if self._reducing:
            self._stage_grad(param)
        self.gatherer.grad_ready(param)

    def _stage_grad(self, param: nn.Parameter) -> None:
        """Mark ``param``'s gradient ready (at stage 2 and 3, copied into its bucket's
        staging buffer) and launch the buckets that are complete, in order."""
        bucket = self._bucket_of[param]
        if self.stage >= 2:
            if bucket.staging is None:
                bucket.staging = torch.zeros(bucket.padded, dtype=param.dtype, device=param.device)
            offset = self._offset_of[param]
            bucket.staging[offset : offset + param.grad.numel()].copy_(param.grad.reshape(-1))
            param.grad = None
        bucket.ready.add(id(param))
        self._launch_ready(force=False)

    def _launch_ready(self, *, force: bool) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.frozen:  # no gradient to reduce
                self._next_launch += 1
                continue
            if not force and len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: ShardedBucket) -> None:
        if self.stage >= 2 and bucket.staging is None:  # no gradient reached it this micro-step
            bucket.staging = torch.zeros(bucket.padded, dtype=bucket.flat_param.dtype, device=bucket.flat_param.device)
        source = bucket.grad_full if self.stage == 1 else bucket.staging
        if self.predivide_factor != 1.0:
            source.div_(self.predivide_factor)
        # the source is scratch: the staging buffer is dropped after, and at stage 1 the
        # full gradients are zeroed at the step (only this rank's slice is read)
        bucket.handle, bucket.out = bucket.comm.reduce_scatter_scratch(source, tag=f"gradient bucket {bucket.index}")
        self._in_flight.append(bucket)
        if self.stage >= 2 and len(self._in_flight) > _MAX_IN_FLIGHT:
            self._complete(self._in_flight.popleft())

    def _complete(self, bucket: ShardedBucket) -> None:
        bucket.handle.wait()
        # the data-parallel size for expert buckets too: see [Note: expert groups]
        out = bucket.out.div_(self.comm.world_size / self.predivide_factor)
        if self.stage >= 2:
            self._into_grad_shard(bucket, out, accumulate=True)
            bucket.staging = None
        else:
            bucket.local(bucket.grad_full, bucket.comm.rank).copy_(out)
            if not same_storage(bucket.grad_shard, bucket.grad_full):
                self._into_grad_shard(bucket, out, accumulate=False)
        bucket.out = bucket.handle = None

    def _into_grad_shard(self, bucket: ShardedBucket, out: torch.Tensor, *, accumulate: bool) -> None:
        """Add (or copy) a reduced gradient shard into ``bucket.grad_shard``. An offloaded
        shard on the CPU receives it through a copy that overlaps backward (see [Note: host
        copies] in ``offload/_copies.py``); at most ``_MAX_IN_FLIGHT`` copies wait at once.
        (On the CPU the copy is the tensor itself, landed at once, through the same queue.)"""
        if not self.gatherer.offloads():
            self._fold(bucket, out, accumulate)
            return
        if self._host_copies is None:
            self._host_copies = HostCopies(out.device)
        self._to_host.append((bucket, self._host_copies.to_host(out), accumulate))
        self._land_host_copies(keep=_MAX_IN_FLIGHT)

    def _land_host_copies(self, *, keep: int) -> None:
        """Fold the gradient copies that have reached the host into their shards: all that
        are done, and the oldest until at most ``keep`` remain in flight."""
        while self._to_host and (len(self._to_host) > keep or self._to_host[0][1].done()):
            bucket, copy, accumulate = self._to_host.popleft()
            self._fold(bucket, copy.result(), accumulate)

    @staticmethod
    def _fold(bucket: ShardedBucket, shard: torch.Tensor, accumulate: bool) -> None:
        if accumulate:
            bucket.grad_shard.add_(shard)
        else:
            bucket.grad_shard.copy_(shard)

    def finalize_backward(self) -> None:
        """Launch what is left and wait for every reduction of this micro-step (and, when
        offloaded, for its gradient shards to reach CPU memory); then the gatherer's
        ``backward_done``."""
        if self._reducing:
            self._launch_ready(force=True)
            while self._in_flight:
                self._complete(self._in_flight.popleft())
            self._land_host_copies(keep=0)
            self._reducing = False
        self.gatherer.backward_done()

    # -- step -------------------------------------------------------------------------------

    def step(self, *, max_grad_norm: float, loss_scale: float) -> StepResult:
        """Unscale, take the global norm across shards, skip on overflow, clip, update, gather."""
        self._zero_new_grads()  # a step with no backward before it sees zero gradients
        grads = [b.grad_shard for b in self.buckets if not b.frozen]
        if loss_scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / loss_scale)
        # see [Note: the global norm over the grid] in _strategy.py
        local = self.model_parallel.local_square(grads, self._replicated_grad_views())
        device = self.buckets[0].flat_param.device if self.buckets else local.device
        total = local.to(device, torch.float64).reshape(1)  # the collective runs on the model's device
        self.comm.all_reduce(total, tag="gradient norm").wait()
        self.model_parallel.reduce_(total)
        norm = total.clamp_min(0).sqrt()
        if self.policy.skip_nonfinite and not torch.isfinite(norm):
            self.zero_grad()
            return StepResult(False, float(norm))
        if max_grad_norm > 0:
            clip_by_total_norm_(grads, max_grad_norm, float(norm))
        if self.swapper is not None:
            self.swapper.step(
                lambda indices: self.gatherer.copy_masters_to_params([self.buckets[i] for i in indices]),
                timer=self.timer,
            )
        else:
            self.optimizer.step()
            self.gatherer.copy_masters_to_params(self.buckets)
        self.gatherer.gather_params()
        self.zero_grad()
        return StepResult(True, float(norm))

    def _replicated_grad_views(self) -> list[tuple[torch.Tensor, float]]:
        """The parts of this rank's gradient shards whose parameters other ranks hold
        copies of (see ``ModelParallel.weight``), with their weight; none without tensor
        parallelism or tied pipeline weights."""
        if not self.model_parallel.comms:
            return []
        views = []
        for bucket in self.buckets:
            if bucket.frozen:
                continue
            low = bucket.comm.rank * bucket.shard
            for p, offset, shape in zip(bucket.params, bucket.offsets, bucket.shapes):
                start, end = max(offset, low), min(offset + shape.numel(), low + bucket.shard)
                if start < end and (weight := self.model_parallel.weight(p)) != 1.0:
                    views.append((bucket.grad_shard[start - low : end - low], weight))
        return views

    @contextlib.contextmanager
    def _resident(self, buckets: list[ShardedBucket]):
        """Masters and optimizer state of ``buckets`` in memory for the block (nvme tier)."""
        if self.swapper is None:
            yield
            return
        with self.swapper.resident([b.index for b in buckets]):
            yield

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            if bucket.grad_shard is not None:
                bucket.grad_shard.zero_()
            if bucket.grad_full is not None:
                bucket.grad_full.zero_()

    def release_gathered(self) -> None:
        """Free parameters held gathered beyond their use (see the gatherer's)."""
        self.gatherer.release_gathered()
