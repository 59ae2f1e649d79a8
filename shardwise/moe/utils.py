"""DeepSpeed's MoE parameter helpers (``deepspeed.moe.utils``). Expert parameters carry
``allreduce = False`` and the ``group_name`` of their expert groups (``ep_size_<n>``);
the optimizer may keep them in param groups of their own (``"moe": True``)."""

from __future__ import annotations

import torch
from torch import nn


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts of the first MoE layer)`` when ``m`` has MoE layers, else ``(False, 0)``."""
    from shardwise.moe.layer import MoE

    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter (reduced within its expert group only)."""
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict) -> bool:
    return param_group.get("moe", False)


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    """``(shared, expert)`` parameters of ``params``."""
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group) -> tuple[list, list]:
    """``(shared, expert)`` gradients of the parameters in ``group`` that have one."""
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971) -> list[dict]:
    """The param groups with their expert parameters moved out, followed by one group per
    (original group, expert group name) holding them, with the original's options,
    ``"name"`` the expert group name and ``"moe": True``; groups of more than
    ``max_group_size`` elements are cut into several. As DeepSpeed, ``param_groups`` (a
    dict, a tuple or a list of dicts) is modified in place."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"param_groups must be a dict or a list or tuple of dicts, got {type(param_groups).__name__}")
    expert_groups = []
    for group in param_groups:
        by_name: dict[str, list] = {}
        dense = []
        for p in group["params"]:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
            else:
                dense.append(p)
        group["params"] = dense
        for name, params in by_name.items():
            for chunk in _chunks(params, max_group_size):
                expert_groups.append({**group, "name": name, "moe": True, "params": chunk})
    return param_groups + expert_groups


def _chunks(params: list, max_numel) -> list[list]:
    if max_numel is None:
        return [params]
    chunks, current, size = [], [], 0
    for p in params:
        numel = getattr(p, "ds_numel", p.numel())
        if current and size + numel > max_numel:
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += numel
    return chunks + ([current] if current else [])


def configure_moe_param_groups(model_parameters: list):
    """Param groups with the experts apart, from a list of parameters (one dense group
    named ``dense-params``) or of param groups (split unless some are MoE groups already)."""
    if not isinstance(model_parameters, list):
        raise TypeError(f"model_parameters must be a list, got {type(model_parameters).__name__}")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(f"the optimizer takes tensors or param-group dicts, got {type(p).__name__}")
    if model_parameters and isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if any("moe" in group for group in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
