"""Equivalence checks: train with plain PyTorch in one process and with an engine on N
ranks on the same global batches, then compare parameters."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

STAGE3_PARTITION_ALL = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
"""Stage 3 settings that partition even tiny test models and regather for backward.

DeepSpeed's defaults keep parameters under 1e5 elements whole and keep a module's
parameters from its forward to its backward when fewer than 1e9 elements are gathered in
between, which for a test-sized model means nothing is ever partitioned."""


def param_groups(model, *, split: bool, lr: float, weight_decay: float):
    """All parameters in one group, or (``split``) matrices with weight decay and vectors
    without it at half the lr: the usual transformer recipe, to test per-group options."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not split:
        return params
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": lr / 2},
    ]


@dataclass(frozen=True)
class ReferenceRun:
    """What single-process training did: the trained copy, its starting point and the
    global gradient norm of every step (``clip_grad_norm_``'s value, before clipping)."""

    model: torch.nn.Module
    initial: list[torch.Tensor]
    norms: list[float]

    def movement(self) -> float:
        """Largest distance training moved any element: a tolerance below a fraction of
        it fails an engine that never updates the parameters."""
        return max((p.detach() - q).abs().max().item() for p, q in zip(self.model.parameters(), self.initial))

    def update_error(self, module) -> float:
        """``|module - reference| / |reference - initial|`` over all parameters together
        (gathered if partitioned): how far the engine's update is from the reference's, as
        a fraction of it (1.0 for an engine that never updated). Unlike the largest
        element difference it is not dominated by the few near-zero gradients that Adam
        turns into full-size updates of either sign under 16-bit rounding."""
        from shardwise.zero import GatheredParameters

        with GatheredParameters(list(module.parameters())):
            got = [p.detach().float() for p in module.parameters()]
            off = sum((g - r.detach()).pow(2).sum() for g, r in zip(got, self.model.parameters()))
        moved = sum((r.detach() - q).pow(2).sum() for r, q in zip(self.model.parameters(), self.initial))
        return float((off / moved).sqrt())


def reference_run(
    model,
    batches,
    *,
    lr: float,
    clip: float,
    weight_decay: float = 0.0,
    split_groups: bool = False,
    optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
    **optimizer_options,
) -> ReferenceRun:
    """Train a copy of ``model`` on full global batches with ``optimizer`` (torch's AdamW by
    default; SGD is sensitive to the gradient's scale, which AdamW hides); clip at ``clip``
    when positive. ``optimizer_options`` go to its constructor."""
    model = copy.deepcopy(model)
    initial = [p.detach().clone() for p in model.parameters()]
    groups = param_groups(model, split=split_groups, lr=lr, weight_decay=weight_decay)
    step = optimizer(groups, lr=lr, weight_decay=weight_decay, **optimizer_options)
    norms = []
    for tokens, targets in batches:
        model(tokens, targets).backward()
        # an infinite max_norm measures without clipping
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))))
        step.step()
        step.zero_grad()
    return ReferenceRun(model, initial, norms)


def reference_train(model, batches, *, lr: float, weight_decay: float, clip: float, split_groups: bool):
    """Train a copy of ``model`` on full global batches with torch.optim.AdamW; returns it."""
    return reference_run(model, batches, lr=lr, weight_decay=weight_decay, clip=clip, split_groups=split_groups).model


def engine_train(engine, batches, *, rank: int, world_size: int, micro: int) -> list[float]:
    """Feed each rank its micro-batches of every global batch through the engine; returns
    the gradient norm of every optimizer step (to check that clipping was exercised)."""
    norms = []
    for tokens, targets in batches:
        for step in range(engine.gradient_accumulation_steps()):
            start = (step * world_size + rank) * micro
            engine.backward(engine(tokens[start : start + micro], targets[start : start + micro]))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return norms


def max_param_diff(reference, module) -> float:
    """Largest absolute difference between corresponding parameters (gathered if partitioned)."""
    from shardwise.zero import GatheredParameters

    with GatheredParameters(list(module.parameters())):
        return max(
            (a.detach() - b.detach().float()).abs().max().item()
            for a, b in zip(reference.parameters(), module.parameters())
        )


def grad_bytes_outside(module, counted: list[torch.Tensor]) -> int:
    """Bytes of the storages behind the module parameters' ``.grad`` that are not among
    ``counted`` (the strategy's own gradient buffers): what ``model_state_bytes`` would
    miss if a stage left full gradients on the parameters."""
    known = {t.untyped_storage().data_ptr() for t in counted}
    seen, total = set(), 0
    for p in module.parameters():
        if p.grad is None:
            continue
        storage = p.grad.untyped_storage()
        if storage.data_ptr() not in known and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def full_parameters(engine) -> dict[str, torch.Tensor]:
    """Every parameter of ``engine.module`` as a single-process model holds it (collective):
    ZeRO-3 partitions gathered, tensor-parallel shards all-gathered over the grid's tensor
    group and put back in the original layout (``shardwise.tensor_parallel.autotp.full_tensor``)."""
    import torch.distributed as dist

    from shardwise.tensor_parallel import shard_info
    from shardwise.tensor_parallel.autotp import full_tensor
    from shardwise.zero import GatheredParameters

    group = engine.grid.get_tensor_model_parallel_group()
    out = {}
    with GatheredParameters(list(engine.module.parameters())):
        for name, p in engine.module.named_parameters():
            value = p.detach().clone()
            if shard_info(p) is not None:
                pieces = [torch.empty_like(value) for _ in range(engine.grid.tensor)]
                dist.all_gather(pieces, value.contiguous(), group=group)
                value = full_tensor(pieces, p)
            out[name] = value
    return out
