"""DeepSpeed's MoE parameter helpers: expert parameters carry ``allreduce = False`` and a
``group_name``; nothing in this version of shardwise creates such parameters."""

from __future__ import annotations

import torch


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter (reduced within its expert group only)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    """``(shared, expert)`` parameters of ``params``."""
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971) -> list[dict]:
    """Optimizer param groups with expert parameters moved into groups of their own (one
    per expert group name, flagged ``moe: True``); groups without expert parameters are
    returned as they are. ``param_groups`` may be one dict, a list of dicts, or
    (name, parameter) tuples as DeepSpeed accepts."""
    del max_group_size
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = [{"params": list(param_groups)}]
    out = []
    for group in param_groups:
        params = list(group["params"])
        shared = [p for p in params if not is_moe_param(p)]
        out.append({**group, "params": shared})
        by_name: dict[str, list] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        for name, experts in by_name.items():
            out.append({**group, "params": experts, "name": name, "moe": True})
    return out
