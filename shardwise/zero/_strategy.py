"""The interface every ZeRO stage implements; the engine talks only to this."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """The factor clipping multiplies the gradients by (torch's rule: ``max_norm /
    (total_norm + 1e-6)`` when below 1); 1.0 when ``max_norm`` is 0 (no clipping)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (float(total_norm) + 1e-6))


def clip_by_total_norm_(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` in place so their total norm is at most ``max_norm`` (see
    :func:`clip_coefficient`)."""
    coef = clip_coefficient(max_norm, total_norm)
    if grads and coef < 1.0:
        torch._foreach_mul_(grads, coef)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is one tensor-parallel rank's slice of a larger parameter (marked
    ``tensor_model_parallel`` by shardwise's and Megatron's layers, ``model_parallel`` by
    older DeepSpeed code), rather than a copy every tensor rank holds."""
    return bool(getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False))


@dataclass(frozen=True)
class ModelParallel:
    """What a ZeRO strategy needs of the grid's axes beyond data parallelism: the global
    gradient norm.

    [Note: the global norm over the grid]
    The norm clipping and the overflow check use is the norm of the whole model's
    gradient, each element counted once. A strategy sums the squares it holds, reduces
    them over its data-parallel group when it holds shards, and then over ``comms`` (the
    tensor and pipeline groups of size > 1). Tensor-parallel slices are distinct on each
    tensor rank and count fully; parameters every tensor rank holds a copy of (LayerNorm
    weights, row-parallel biases) would count ``tensor`` times, so their squares are
    weighted ``1 / tensor`` before the sum; likewise a tied weight held by ``k`` pipeline
    stages (``param.pipe_copies``, set by the pipeline engine) is weighted ``1 / k``. An
    infinite or NaN gradient anywhere makes the
    sum non-finite on every rank, so every rank of the grid skips the same fp16 step.
    """

    tensor: int = 1
    comms: tuple = ()
    """Communicators over the tensor and pipeline groups with more than one rank."""

    @classmethod
    def from_grid(cls, grid) -> ModelParallel:
        if grid is None:
            return cls()
        comms = tuple(c for size, c in ((grid.tensor, "tensor_comm"), (grid.pipe, "pipe_comm")) if size > 1)
        return cls(tensor=grid.tensor, comms=tuple(getattr(grid, c) for c in comms))

    def weight(self, param: torch.Tensor) -> float:
        """How much ``param``'s squares count: ``1 / tensor`` for a copy every tensor rank
        holds, ``1 / k`` for a tied weight held by ``k`` pipeline stages, else 1."""
        weight = 1.0 / self.tensor if self.tensor > 1 and not is_tensor_parallel(param) else 1.0
        return weight / getattr(param, "pipe_copies", 1)

    def local_square(self, grads: list[torch.Tensor], weighted: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
        """Sum of squares of ``grads`` (fp64), the elements also in ``weighted`` (views
        into them, with their weight below 1) counted at that weight."""
        total = (
            torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
            if grads
            else torch.zeros((), dtype=torch.float64)
        )
        if weighted:
            norms = torch.stack(torch._foreach_norm([v for v, _ in weighted])).double().pow(2)
            factors = torch.tensor([1.0 - w for _, w in weighted], dtype=torch.float64, device=norms.device)
            total = total - (factors * norms).sum().to(total.device)
        return total

    def reduce_(self, square: torch.Tensor) -> None:
        """Sum ``square`` (a one-element tensor) over the tensor and pipeline groups."""
        for comm in self.comms:
            comm.all_reduce(square, tag="gradient norm").wait()


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""

    applied: bool
    """False when the step was skipped (fp16 overflow)."""
    grad_norm: float
    """Global gradient norm before clipping (unscaled, fp32); inf/nan on overflow."""


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state this rank holds, by kind (exact, from the tensors)."""

    params: int
    grads: int
    master_params: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master_params + self.optimizer_state


@dataclass(frozen=True)
class ShardBlock:
    """One optimizer state tensor of one ZeRO bucket, as a checkpoint lays it out: the
    bucket's parameters' full tensors one after another (``names``, ``shapes``), then
    ``padded`` minus their elements of padding, so rank ``r``'s shard is the ``shard``
    elements from element ``r * shard``: one contiguous write per rank, no gather. See
    ``optimizer_state_blocks`` and ``runtime/_checkpointing.py``."""

    bucket: int
    key: str
    """The optimizer state key (``exp_avg``...), ``MASTER_KEY`` or ``PARAM_KEY``."""
    dtype: torch.dtype
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    padded: int
    shard: int
    holder_rank: int | None = None
    """This rank's place among the ranks the bucket is sharded over, when that is not the
    data-parallel group (an expert bucket's expert-data-parallel group); None: its data rank."""


MASTER_KEY = "__master__"
"""The ``ShardBlock.key`` of a bucket's fp32 master weights."""
PARAM_KEY = "__param__"
"""The ``ShardBlock.key`` of a bucket's parameters (the module's own weights)."""
GRAD_KEY = "__grad__"
"""For ``full_param_state``: a parameter's reduced gradient."""


class ZeroViews(Protocol):
    """The state and checkpoint views of a ZeRO strategy (``strategy.views``; implemented
    over the shared layout in ``_views.py``): what checkpoints, the engine's state
    accessors and ``engine.offload_states`` read and write, apart from the step.

    Checkpoints read the state in two parts: what every rank holds alike
    (``*_replicated``) and the ZeRO-sharded tensors as ``ShardBlock`` lists with each
    bucket's shards (``*_blocks``, ``*_shards``); ``module_state_pieces`` gives the full
    module state a piece at a time (collective at stage 3).

    One parameter's state (``shardwise.zero.safe_get_full_fp32_param`` and friends):
    ``full_param_state(param, key)`` gives the whole tensor of ``key`` (``MASTER_KEY``: the
    fp32 master, ``GRAD_KEY``: the reduced gradient as held, loss-scaled under fp16; else
    an optimizer state key) and is collective; ``local_param_state`` gives this rank's
    part of it, flattened; ``set_param_state`` writes either form back. Every trainable
    parameter points to its strategy through ``param._shardwise_strategy`` (a weakref).

    ``state_tensors(kind)`` lists the tensors holding one kind of state, by DeepSpeed's
    ``OffloadStateTypeEnum`` names (``optim_states``, ``hp_params``: fp32 masters that are
    copies, ``lp_params``: the module's parameters, ``lp_grads``, ``contiguous_grad_buffer``),
    for ``engine.offload_states``.
    """

    def model_state_bytes(self) -> ModelStateBytes: ...

    def optimizer_state_by_name(self) -> dict: ...

    def optimizer_state_replicated(self) -> dict: ...

    def optimizer_state_blocks(self) -> list[ShardBlock]: ...

    def optimizer_shards(self, bucket: int) -> AbstractContextManager[dict[str, torch.Tensor]]: ...

    def module_state_replicated(self) -> dict: ...

    def module_state_pieces(self) -> Iterator[dict[str, torch.Tensor]]: ...

    def module_state_blocks(self) -> list[ShardBlock]: ...

    def module_shards(self, bucket: int) -> AbstractContextManager[dict[str, torch.Tensor]]: ...

    def load_optimizer_state_by_name(self, saved: dict) -> None: ...

    def sync_params_from_master(self) -> None: ...

    def reset_master_from_params(self) -> None: ...

    def module_state_dict(self) -> dict: ...

    def load_module_state_dict(self, state: dict, *, strict: bool): ...

    def full_param_state(self, param, key: str) -> torch.Tensor | None: ...

    def local_param_state(self, param, key: str) -> torch.Tensor | None: ...

    def set_param_state(self, param, key: str, value: torch.Tensor, *, local: bool) -> None: ...

    def state_tensors(self, kind: str) -> list[torch.Tensor]: ...


class ZeroStrategy(Protocol):
    """How parameters, gradients and optimizer state are held and reduced across ranks:
    the step lifecycle. The state and checkpoint views are ``views`` (:class:`ZeroViews`).

    Lifecycle per micro-step: ``pre_backward(boundary=..., sync=...)`` before the loss's
    backward, gradient hooks fire during it, ``finalize_backward()`` after it; at the
    accumulation boundary ``step()`` updates the parameters. ``release_gathered()`` frees
    parameters held gathered beyond their use (stage 3; nothing elsewhere).
    """

    optimizer: torch.optim.Optimizer
    views: ZeroViews
    timer: Callable[[str], AbstractContextManager]
    """Times the waits the strategy adds to a step (``gather_params``,
    ``optimizer_swap_in_state``, ``optimizer_swap_out_state``): the engine sets it to its
    wall-clock timer; :func:`no_timer` until then."""

    def optimizer_params(self, model_parameters) -> list: ...

    def without_optimizer(self, params: list) -> None:
        """Prepare ``params`` for an engine built without an optimizer."""
        ...

    def pre_backward(self, *, boundary: bool, sync: bool) -> None: ...

    def finalize_backward(self) -> None: ...

    def step(self, *, max_grad_norm: float, loss_scale: float) -> StepResult: ...

    def zero_grad(self) -> None: ...

    def release_gathered(self) -> None: ...


def no_timer(name: str) -> AbstractContextManager:
    """A strategy's ``timer`` before the engine gives it its own: times nothing."""
    return nullcontext()
