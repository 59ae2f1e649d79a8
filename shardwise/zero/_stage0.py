"""ZeRO stage 0: replicated data parallelism with bucketed, overlapped all-reduce.

Every rank holds the full parameters, gradients and optimizer state. Gradients live in
flat per-bucket buffers; each parameter's ``.grad`` is a view into its bucket, so autograd
accumulates straight into the buffer that is communicated.

[Note: bucket launch order]
A bucket's all-reduce is launched from the post-accumulate-grad hook of the last of its
parameters to receive a gradient on the boundary micro-step, but only after every
earlier bucket has been launched. Buckets therefore start in one fixed order on every
rank even when hooks fire in different orders (or a parameter gets no gradient on some
rank); buckets still pending when backward ends are launched by ``finalize_backward``.
Collectives issued in different orders on different ranks would deadlock or mix data.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.comm import Communicator, Handle
from shardwise.precision import PrecisionPolicy
from shardwise.zero._strategy import (
    ModelParallel,
    StepResult,
    clip_by_total_norm_,
    is_tensor_parallel,
    no_timer,
)
from shardwise.zero._views import Stage0Views

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _AllReduceBucket:
    """Gradients laid out back to back in one flat buffer that stage 0 all-reduces whole
    (parameters stay where they are)."""

    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    comm: Communicator
    """The data-parallel group, or an expert bucket's expert-data-parallel group."""
    ready: set[int] = field(default_factory=set)
    handle: Handle | None = None
    launched: bool = False


def broadcast_module_state(module: nn.Module, comm: Communicator, expert_comms: dict | None = None) -> None:
    """Make every rank start from rank 0's parameters and buffers (one broadcast per dtype);
    expert parameters (keys of ``expert_comms``) from the first rank of their
    expert-data-parallel group instead, since each expert-parallel rank holds other experts."""
    expert_comms = expert_comms or {}
    shared = [p for p in module.parameters() if p not in expert_comms] + list(module.buffers())
    _broadcast(shared, comm)
    by_comm: dict[int, tuple[Communicator, list[torch.Tensor]]] = {}
    for p in module.parameters():
        if p in expert_comms:
            by_comm.setdefault(id(expert_comms[p]), (expert_comms[p], []))[1].append(p)
    for expert_comm, params in by_comm.values():
        _broadcast(params, expert_comm)


def _broadcast(tensors: list[torch.Tensor], comm: Communicator) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for dtype, group in by_dtype.items():
            flat = torch.cat([t.reshape(-1) for t in group])
            comm.broadcast(flat, src=0, tag=f"initial {dtype} state").wait()
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


class Stage0Strategy:
    """Replicated parameters; gradients all-reduced in buckets during backward.

    Construction casts the module to ``policy.param_dtype``, broadcasts parameters and
    buffers from rank 0, builds the gradient buckets and registers the hooks. When the
    parameters are lower precision, fp32 master copies are what the optimizer updates.

    Args:
        module: the model; modified in place.
        comm: the data-parallel communicator.
        policy: dtypes of parameters and master weights.
        bucket_numel: elements per gradient bucket (smaller overlaps more, larger
            issues fewer collectives).
        predivide_factor: divide gradients by this before the all-reduce and by
            ``world_size / predivide_factor`` after it (1.0 = average after).
        expert_comms: expert parameters -> the communicator of the ranks holding the same
            experts, over which their buckets are all-reduced (see [Note: expert groups] in
            ``parallel/_expert.py``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        comm: Communicator,
        policy: PrecisionPolicy,
        bucket_numel: int,
        predivide_factor: float = 1.0,
        model_parallel: ModelParallel = ModelParallel(),
        expert_comms: dict | None = None,
    ):
        self.module, self.comm, self.policy = module, comm, policy
        self.expert_comms = expert_comms or {}
        self.timer = no_timer  # nothing of its own to time: its all-reduces are the backward's
        self.model_parallel = model_parallel
        self.predivide_factor = predivide_factor
        self.optimizer: torch.optim.Optimizer | None = None
        module.to(policy.param_dtype)
        broadcast_module_state(module, comm, self.expert_comms)
        self.trainable = [p for p in module.parameters() if p.requires_grad]
        self._master = {p: self._make_master(p) for p in self.trainable} if policy.needs_master_copy else {}
        self._param_of_master = {id(master): p for p, master in self._master.items()}
        self.buckets = self._build_buckets(bucket_numel)
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._sync = False
        self._grads_local = False
        """Whether this step's gradients were left unreduced because the optimizer
        exchanges data itself (see [Note: optimizers that exchange data themselves] in
        ``optim/onebit/_base.py``)."""
        self._next_launch = 0
        self.views = Stage0Views(self)
        """The state and checkpoint views (``ZeroViews``)."""
        self._attach_grad_views()
        for p in self.trainable:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            p._shardwise_strategy = weakref.ref(self)

    # -- construction -----------------------------------------------------------------

    @staticmethod
    def _make_master(p: nn.Parameter) -> nn.Parameter:
        master = nn.Parameter(p.detach().to(torch.float32, copy=True))
        master.grad = torch.zeros_like(master)
        return master

    def _build_buckets(self, bucket_numel: int) -> list[_AllReduceBucket]:
        # Reverse registration order approximates the order backward produces gradients.
        buckets: list[_AllReduceBucket] = []
        pending: list[nn.Parameter] = []
        for p in reversed(self.trainable):
            if pending and (
                sum(q.numel() for q in pending) + p.numel() > bucket_numel
                or pending[0].dtype != p.dtype
                or self._comm_of(pending[0]) is not self._comm_of(p)
            ):
                buckets.append(self._new_bucket(len(buckets), pending))
                pending = []
            pending.append(p)
        if pending:
            buckets.append(self._new_bucket(len(buckets), pending))
        return buckets

    def _comm_of(self, param: nn.Parameter) -> Communicator:
        return self.expert_comms.get(param, self.comm)

    def _new_bucket(self, index: int, params: list[nn.Parameter]) -> _AllReduceBucket:
        numel = sum(p.numel() for p in params)
        buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        return _AllReduceBucket(index, params, buffer, self._comm_of(params[0]))

    def _attach_grad_views(self) -> None:
        """Point every ``.grad`` at its slice of the bucket buffer (re-run after user code
        replaced or dropped a ``.grad``, e.g. ``model.zero_grad()``)."""
        for bucket in self.buckets:
            offset = 0
            for p in bucket.params:
                view = bucket.buffer[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                else:
                    continue
                p.grad = view

    # -- optimizer wiring ---------------------------------------------------------------

    def without_optimizer(self, params: list) -> None:
        """An engine with no optimizer: nothing to lay out."""

    def optimizer_params(self, model_parameters):
        """Map what the user passed as ``model_parameters`` to what the optimizer updates."""
        if not self._master:
            return model_parameters
        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            return [{**g, "params": [self._master.get(p, p) for p in g["params"]]} for g in items]
        return [self._master.get(p, p) for p in items]

    def adopt_client_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make a user-built optimizer update the master copies instead of the params."""
        if self._master:
            for group in optimizer.param_groups:
                group["params"] = [self._master.get(p, p) for p in group["params"]]
        self.optimizer = optimizer
        if hasattr(optimizer, "bind_data_parallel"):
            optimizer.bind_data_parallel(self.comm, exchange_key=self._exchange_key)
        return optimizer

    def _exchange_key(self, optimizer_param) -> str:
        """Which compressed exchange ``optimizer_param`` joins (see [Note: copies on several
        model-parallel ranks] in ``optim/onebit/_base.py``)."""
        param = self._param_of_master.get(id(optimizer_param), optimizer_param)
        tied = getattr(param, "pipe_tied_key", None)
        if tied is not None:
            return f"tied:{tied}"
        if self.model_parallel.tensor > 1 and not is_tensor_parallel(param):
            return "tensor-replicated"
        return "own"

    # -- backward -----------------------------------------------------------------------

    def pre_backward(self, *, boundary: bool, sync: bool) -> None:
        """Arm the hooks: reduce during this backward only on a synced boundary step."""
        self._attach_grad_views()
        if boundary:
            exchanges = getattr(self.optimizer, "averages_gradients_itself", None)
            self._grads_local = exchanges is not None and exchanges()
        self._sync = boundary and sync and not self._grads_local
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.launched, bucket.handle = False, None

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        bucket = self._bucket_of[param]
        bucket.ready.add(id(param))
        self._launch_ready_buckets()

    def _launch_ready_buckets(self, *, force: bool = False) -> None:
        # See [Note: bucket launch order].
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not force and len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: _AllReduceBucket) -> None:
        if self.predivide_factor != 1.0:
            bucket.buffer.div_(self.predivide_factor)
        bucket.handle = bucket.comm.all_reduce(bucket.buffer, tag=f"gradient bucket {bucket.index}")
        bucket.launched = True

    def finalize_backward(self) -> None:
        """Launch what is left, wait for every bucket and average the gradients."""
        if not self._sync:
            return
        self._launch_ready_buckets(force=True)
        # the data-parallel size for expert buckets too: see [Note: expert groups]
        post = self.comm.world_size / self.predivide_factor
        for bucket in self.buckets:
            bucket.handle.wait()
            if post != 1.0:
                bucket.buffer.div_(post)
        self._sync = False

    # -- step ---------------------------------------------------------------------------

    def _grads_for_optimizer(self, inv_scale: float) -> list[torch.Tensor]:
        if not self._master:
            grads = [p.grad for p in self.trainable]
            if inv_scale != 1.0:
                torch._foreach_mul_(grads, inv_scale)
            return grads
        masters = [self._master[p] for p in self.trainable]
        master_grads = [m.grad for m in masters]
        torch._foreach_copy_(master_grads, [p.grad for p in self.trainable])
        if inv_scale != 1.0:
            torch._foreach_mul_(master_grads, inv_scale)
        return master_grads

    def step(self, *, max_grad_norm: float, loss_scale: float) -> StepResult:
        """Unscale, check for overflow, clip and apply the optimizer to the reduced grads."""
        grads = self._grads_for_optimizer(1.0 / loss_scale)
        # local gradients: the ranks still agree on overflow and on the clipping norm (the
        # root mean square of the ranks' norms), one scalar; nothing when neither is used
        agree = self._grads_local and (self.policy.skip_nonfinite or max_grad_norm > 0)
        if self.model_parallel.comms or agree or self.expert_comms:
            # see [Note: the global norm over the grid] in _strategy.py
            square = self._local_square(grads)
            if agree:
                self.comm.all_reduce(square, tag="local gradient norm").wait()
                square.div_(self.comm.world_size)
            elif self.expert_comms:  # each element once: every data rank holds a copy of
                # a shared gradient, every expert-data-parallel rank one of an expert's
                self.comm.all_reduce(square, tag="gradient norm").wait()
            mp = self.model_parallel
            mp.reduce_(square)
            norm = square.clamp_min(0).sqrt()[0]
        else:
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        norm_value = float(norm)
        if self.policy.skip_nonfinite and not torch.isfinite(norm):
            self.zero_grad()
            return StepResult(False, norm_value)
        if max_grad_norm > 0:
            clip_by_total_norm_(grads, max_grad_norm, norm_value)
        self.optimizer.step()
        self.views.sync_params_from_master()
        self.zero_grad()
        return StepResult(True, norm_value)

    def _local_square(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """This rank's weighted sum of squares (one element tensor): copies on other
        tensor or pipeline ranks weighted by ``ModelParallel.weight``; with experts, also
        by one over the number of data ranks holding the same gradient."""
        mp = self.model_parallel
        weights = [mp.weight(p) for p in self.trainable]
        if self.expert_comms:
            weights = [w / self._comm_of(p).world_size for w, p in zip(weights, self.trainable)]
        square = mp.local_square(grads, [(g, w) for g, w in zip(grads, weights) if w != 1.0])
        return square.to(grads[0].device if grads else square.device).reshape(1)

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def release_gathered(self) -> None:
        """Nothing is gathered beyond use at stage 0."""
