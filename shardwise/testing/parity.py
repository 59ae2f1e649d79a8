"""Equivalence checks: train with plain PyTorch in one process and with an engine on N
ranks on the same global batches, then compare parameters."""

from __future__ import annotations

import copy

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
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": lr / 2}]


def reference_train(model, batches, *, lr: float, weight_decay: float, clip: float, split_groups: bool):
    """Train a copy of ``model`` on full global batches with torch.optim.AdamW; returns it."""
    model = copy.deepcopy(model)
    groups = param_groups(model, split=split_groups, lr=lr, weight_decay=weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    for tokens, targets in batches:
        model(tokens, targets).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return model


def engine_train(engine, batches, *, rank: int, world_size: int, micro: int) -> list[float]:
    """Feed each rank its micro-batches of every global batch through the engine; returns
    the gradient norm of every optimizer step (to check that clipping was exercised)."""
    norms = []
    for tokens, targets in batches:
        for step in range(engine.gradient_accumulation_steps()):
            start = (step * world_size + rank) * micro
            engine.backward(engine(tokens[start:start + micro], targets[start:start + micro]))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return norms


def max_param_diff(reference, module) -> float:
    """Largest absolute difference between corresponding parameters (gathered if partitioned)."""
    from shardwise.zero import GatheredParameters

    with GatheredParameters(list(module.parameters())):
        return max((a.detach() - b.detach().float()).abs().max().item()
                   for a, b in zip(reference.parameters(), module.parameters()))
