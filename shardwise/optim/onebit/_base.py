"""What the 1-bit optimizers share: the data-parallel communicator, the compressed
exchange and its per-rank state.

[Note: optimizers that exchange data themselves]
An ordinary optimizer steps on gradients the ZeRO strategy has averaged across the
data-parallel ranks. The 1-bit family averages something else after its warm-up (1-bit
Adam and 1-bit LAMB the momentum, 0/1 Adam the gradient or the accumulated update), in
compressed form, or nothing at all on 0/1 Adam's local steps. The strategy asks the
optimizer before each accumulation boundary's backward:
``optimizer.averages_gradients_itself()`` True means "leave this step's gradients local,
do not all-reduce them"; the strategy then still agrees on overflow and the clipping norm
across ranks (one scalar), and the optimizer's ``step`` does its own exchange. The
strategy hands the optimizer its data-parallel Communicator with
``optimizer.bind_data_parallel(comm)``, so on a tensor- or pipeline-parallel grid the
compression runs over the data group only. ZeRO stages 1-3 refuse these optimizers (see
``refuse_with_zero``).

[Note: copies on several model-parallel ranks]
A parameter every tensor rank holds a copy of (LayerNorm weights, row-parallel biases),
or a tied weight several pipeline stages hold, must stay identical on all its holders.
Each holder compresses in its own data-parallel group, and compression is not linear:
the scales and signs of a chunk depend on everything else in the chunk. So such copies
travel in exchanges of their own, which hold the same values on every holder (the
strategy's ``exchange_key``: ``"tensor-replicated"`` for the tensor ranks' copies, one
``"tied:<key>"`` per tied pipeline weight, ``"own"`` for the rest); identical inputs and
error buffers then give identical results. Mixing them with a rank's own shards in one
vector lets the copies drift apart after the first compressed step.

Each rank's error buffers differ, so checkpoints keep them per rank
(``rank_state_dict``); the rest of the state (moments, step counts) is Adam's and LAMB's
and is saved by parameter name like theirs.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.distributed as dist

from shardwise.comm import Communicator
from shardwise.comm._compressed import CompressedAllReduce
from shardwise.config._components import ONEBIT_ZERO_REFUSAL

logger = logging.getLogger("shardwise")

COMM_BACKEND_NAMES = ("nccl", "mpi", "hccl", "compressed")
"""The ``comm_backend_name`` values DeepSpeed's 1-bit optimizers accepted; all of them are
served by the torch.distributed backend the job runs on."""


def refuse_with_zero(optimizer, stage: int) -> None:
    """Raise when ``optimizer`` exchanges data itself (a 1-bit optimizer) and ZeRO
    ``stage`` partitions state (see [Note: optimizers that exchange data themselves])."""
    if hasattr(optimizer, "averages_gradients_itself"):
        raise ValueError(ONEBIT_ZERO_REFUSAL.format(name=type(optimizer).__name__, stage=stage))


def check_backend_name(name: str, comm_backend_name: str) -> None:
    if comm_backend_name not in COMM_BACKEND_NAMES:
        raise ValueError(
            f"{name}: comm_backend_name {comm_backend_name!r} is not one of {', '.join(COMM_BACKEND_NAMES)}"
        )


BACKENDS_WITH_ALL_TO_ALL = frozenset({"gloo", "nccl", "mpi", "ucc", "xccl", "hccl"})
"""torch.distributed backends that provide the all-to-all and all-gather the compressed
exchange is made of."""


def check_collectives(name: str, backend: str) -> None:
    """Refuse a process-group backend (``"gloo"``, ``"cpu:gloo,cuda:nccl"``...) that lacks
    the collectives of the compressed exchange."""
    used = {part.split(":")[-1].strip().lower() for part in str(backend).split(",")}
    missing = sorted(used - BACKENDS_WITH_ALL_TO_ALL)
    if missing:
        raise ValueError(
            f"{name} exchanges compressed data with all_to_all_single and all_gather_into_tensor, "
            f"which the process group's backend {backend!r} is not known to provide; run on one of "
            f"{', '.join(sorted(BACKENDS_WITH_ALL_TO_ALL))}"
        )


def check_adam_arguments(name: str, *, amsgrad: bool, lr: float, eps: float, weight_decay: float, betas) -> None:
    """The checks every 1-bit optimizer makes of its Adam-style arguments."""
    if amsgrad:
        raise ValueError(f"{name} does not support amsgrad=True")
    if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
        raise ValueError(
            f"{name}: needs lr, eps, weight_decay >= 0 and betas in [0, 1); got lr={lr}, "
            f"eps={eps}, weight_decay={weight_decay}, betas={tuple(betas)}"
        )


def check_freeze_step(owner: str, key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{owner}: {key} must be an integer >= 1, got {value!r} (the warm-up estimates the "
            "variance that later steps freeze; with no warm-up step it would stay zero)"
        )


# [Note: exchanged tensors live in the flat buffer]
# The compressed exchange works on one flat fp32 vector. The first exchange copies the
# tensors (the momenta) into it and then re-points each tensor at its slice of it
# (``Tensor.set_``), so the optimizer's state tensors are views of the flat buffer from
# then on and later exchanges need no copy in and out (two passes over every parameter's
# state per step). A tensor replaced since (a loaded checkpoint) is copied and re-pointed
# again (safetensors writes such views as they are: they do not overlap).


def _live_in(members: list[torch.Tensor], flat: torch.Tensor) -> bool:
    """Whether ``members`` are, in order, contiguous views covering ``flat``."""
    offset = 0
    storage = flat.untyped_storage().data_ptr()
    for t in members:
        if (
            t.dtype != flat.dtype
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
            or t.storage_offset() != flat.storage_offset() + offset
        ):
            return False
        offset += t.numel()
    return offset == flat.numel()


def _rehome(members: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Point each of ``members`` at its slice of ``flat`` (which holds their values)."""
    offset = flat.storage_offset()
    for t in members:
        t.set_(flat.untyped_storage(), offset, t.shape, t.stride())
        offset += t.numel()


class CompressedOptimizer(torch.optim.Optimizer):
    """Base class of the 1-bit optimizers: binding to the data-parallel ranks, the
    compressed average of a list of tensors, and the per-rank error buffers."""

    def __init__(self, params, defaults: dict, *, comm_backend_name: str, cuda_aware: bool, max_grad_norm: float):
        name = type(self).__name__
        check_backend_name(name, comm_backend_name)
        if max_grad_norm:
            raise ValueError(
                f"{name}: max_grad_norm={max_grad_norm} is not applied by the optimizer; clip with "
                "the top-level 'gradient_clipping' config key"
            )
        super().__init__(params, defaults)
        self.comm_backend_name = comm_backend_name
        self.cuda_aware = cuda_aware
        self._comm: Communicator | None = None
        self._exchange_key = None
        self._exchanges: dict[str, CompressedAllReduce] = {}
        self._flats: dict[tuple[str, bool], torch.Tensor] = {}
        self._pending_rank_state: dict | None = None
        self._unmeasured_cache: dict[int, tuple] = {}

    # -- the engine's side (see [Note: optimizers that exchange data themselves]) ----------

    def bind_data_parallel(self, comm: Communicator, *, exchange_key=None) -> None:
        """Exchange over ``comm`` (the engine's data-parallel communicator).

        ``exchange_key(param) -> str`` names the exchange each optimizer parameter joins
        (see [Note: copies on several model-parallel ranks]); one exchange for all when
        None."""
        self._comm = comm
        self._exchange_key = exchange_key
        if comm.world_size > 1:
            check_collectives(type(self).__name__, dist.get_backend(comm.group))
        if comm.rank == 0 and dist.is_initialized():
            logger.info(
                "%s: comm_backend_name %r: compressed collectives run on torch.distributed's %s "
                "backend over the %d data-parallel ranks",
                type(self).__name__,
                self.comm_backend_name,
                dist.get_backend(comm.group),
                comm.world_size,
            )

    def steps_taken(self) -> int:
        """Optimizer steps taken so far (the largest per-parameter step count)."""
        counts = [float(state["step"]) for state in self.state.values() if "step" in state]
        return int(max(counts)) if counts else 0

    def averages_gradients_itself(self) -> bool:
        """Whether the coming step leaves the gradients local (the strategy does not
        all-reduce them) because the optimizer exchanges data itself."""
        raise NotImplementedError

    def communicator(self) -> Communicator | None:
        """The data-parallel communicator: the bound one, else the default group's when
        the process group is initialised (the optimizer used without the engine), else None."""
        if self._comm is None and dist.is_initialized():
            from shardwise.comm._functional import _communicator

            self._comm = _communicator(None)
        return self._comm

    # -- the compressed exchange ----------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def compressed_average_(
        self, tensors: list[torch.Tensor], *, tag: str, params: list[torch.Tensor] | None = None, state: bool = False
    ) -> None:
        """Replace ``tensors`` (the same shapes on every rank, every call) by their 1-bit
        compressed average over the data-parallel ranks, with error feedback; ``params``
        (the parameter each tensor belongs to) sorts them into their exchanges. ``state``:
        the tensors are this optimizer's own state, which then lives in the exchange's flat
        buffer (see [Note: exchanged tensors live in the flat buffer]); other tensors (the
        gradients) are copied in and out of a scratch buffer."""
        comm = self.communicator()
        if comm is None or comm.world_size == 1:
            return
        groups: dict[str, list[torch.Tensor]] = {}
        names = self.exchange_keys(params) if params is not None else ["all"] * len(tensors)
        for name, tensor in zip(names, tensors):
            groups.setdefault(name, []).append(tensor)
        for name, members in groups.items():
            numel = sum(t.numel() for t in members)
            flat = self._flats.get((name, state))
            if flat is None or flat.numel() != numel:  # kept: a fresh buffer each step costs page faults
                flat = torch.empty(numel, dtype=torch.float32, device=members[0].device)
                self._flats[(name, state)] = flat
            in_place = state and _live_in(members, flat)
            if in_place:
                pass  # the tensors are views of flat already
            elif all(t.dtype == torch.float32 for t in members):
                storage = flat.untyped_storage().data_ptr()
                if any(t.untyped_storage().data_ptr() == storage for t in members):  # views in another order
                    flat.copy_(torch.cat([t.reshape(-1) for t in members]))
                else:
                    torch.cat([t.reshape(-1) for t in members], out=flat)
                if state and all(t.is_contiguous() for t in members):
                    _rehome(members, flat)
                    in_place = True
            else:
                flat.copy_(torch.cat([t.reshape(-1) for t in members]))
            exchange = self._exchanges.get(name)
            if exchange is None or exchange.numel != flat.numel():
                exchange = self._exchanges[name] = CompressedAllReduce(
                    comm, flat.numel(), device=flat.device, tag=f"{type(self).__name__} {tag} ({name})"
                )
                pending = (self._pending_rank_state or {}).get("exchanges", {}).pop(name, None)
                if pending is not None:
                    self._load_exchange(name, pending)
            exchange(flat)
            if not in_place:
                torch._foreach_copy_(
                    members, [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in members]), members)]
                )

    def mask_unmeasured_(self, group: dict, tensor: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Zero what came back from a compressed exchange (a momentum, gradient or update of
        one parameter) where it must not move the parameter: where the group's
        ``exp_avg_mask`` (DeepSpeed's param-group key, a 0/1 tensor that broadcasts to
        the group's parameters) is 0, and where the variance is exactly 0 (no gradient
        has reached the element yet, e.g. the embedding rows of tokens not seen). The
        compressed average gives every element of a chunk the chunk's scale, so such an
        element would otherwise move by ``lr * scale / eps``: DeepSpeed's users had to
        mask them by hand."""
        mask = group.get("exp_avg_mask")
        if mask is not None:
            tensor.mul_(mask.to(tensor.device, tensor.dtype))
        zeros = self._unmeasured(exp_avg_sq)
        if zeros is not None:
            tensor.masked_fill_(zeros, 0.0)

    def _unmeasured(self, exp_avg_sq: torch.Tensor) -> torch.Tensor | None:
        """Where ``exp_avg_sq`` is 0 (None where nowhere), kept while the variance is
        unchanged (frozen): the comparison costs a pass and a fresh bool tensor per step."""
        key = id(exp_avg_sq)
        cached = self._unmeasured_cache.get(key)
        if cached is not None and cached[0]() is exp_avg_sq and cached[1] == exp_avg_sq._version:
            return cached[2]
        zeros = exp_avg_sq == 0
        zeros = zeros if bool(zeros.any()) else None
        self._unmeasured_cache[key] = (weakref.ref(exp_avg_sq), exp_avg_sq._version, zeros)
        return zeros

    def exchange_keys(self, params: list[torch.Tensor]) -> list[str]:
        """The exchange each of ``params`` joins (see [Note: copies on several
        model-parallel ranks]); scalings shared by a group of tensors in one exchange must
        be computed within that exchange only, or the copies drift apart."""
        key = self._exchange_key
        return [key(p) if key is not None else "all" for p in params]

    def reset_error_feedback(self) -> None:
        """Zero the error buffers (0/1 Adam does when its variance freezes)."""
        for exchange in self._exchanges.values():
            exchange.reset()

    # -- per-rank state for checkpoints ---------------------------------------------------

    def rank_state_dict(self) -> dict:
        """This rank's error buffers, by exchange, and the world size they belong to
        (empty before the first compressed step)."""
        if not self._exchanges:
            return {}
        return {
            "world_size": self.communicator().world_size,
            "exchanges": {name: exchange.state_dict() for name, exchange in self._exchanges.items()},
        }

    def load_rank_state_dict(self, state: dict) -> None:
        """Restore what ``rank_state_dict`` gave; error buffers from another world size
        are dropped (they start from zero, logged once)."""
        self.reset_error_feedback()
        self._pending_rank_state = None
        if not state:
            return
        comm = self.communicator()
        world = comm.world_size if comm is not None else 1
        if int(state["world_size"]) != world:
            if comm is None or comm.rank == 0:
                logger.info(
                    "%s: the checkpoint's error-feedback buffers are from %d data-parallel ranks, this "
                    "run has %d; they start from zero",
                    type(self).__name__,
                    int(state["world_size"]),
                    world,
                )
            return
        saved = dict(state["exchanges"])
        for name in list(saved):
            if name in self._exchanges:
                self._load_exchange(name, saved.pop(name))
        self._pending_rank_state = {"exchanges": saved}  # loaded when their exchange is built

    def _load_exchange(self, name: str, state: dict) -> None:
        exchange = self._exchanges[name]
        if state["worker_error"].numel() != exchange.worker_error.numel():
            logger.info(
                "%s: the checkpoint's error-feedback buffers (%s) do not fit this model; they start from zero",
                type(self).__name__,
                name,
            )
            exchange.reset()
            return
        exchange.load_state_dict(state)
