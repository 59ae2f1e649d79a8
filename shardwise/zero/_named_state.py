"""Optimizer state keyed by parameter name: the form every ZeRO stage saves and loads.

A torch optimizer's state_dict indexes parameters by position; positions differ between
ZeRO stages (stage 0 optimizes each parameter, stages 1-2 optimize flat shards) and
between world sizes. Checkpoints therefore store ``{"state": {name: {key: full tensor or
number}}, "param_groups": [{options, "params": [names]}], "master": {name: fp32 tensor}}``
and each stage converts to and from its own layout.
"""

from __future__ import annotations

import torch

from shardwise.checkpoint import CheckpointError


def per_param_state_by_name(optimizer, names: dict[torch.Tensor, str], *, masters: bool) -> dict:
    """The named form of an optimizer that updates one tensor per parameter (stage 0)."""
    index_to_name, index = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            index_to_name[index] = names.get(p, f"unnamed.{index}")
            index += 1
    state = optimizer.state_dict()
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [index_to_name[i] for i in g["params"]]}
        for g in state["param_groups"]
    ]
    by_name = {index_to_name[i]: s for i, s in state["state"].items()}
    master = {name: p.detach() for p, name in names.items()} if masters else {}
    return {"state": by_name, "param_groups": groups, "master": master}


def check_groups(saved: dict, optimizer, known_names) -> None:
    """Refuse a checkpoint whose parameter groups or names do not fit this optimizer."""
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups but this one has "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups, or load with "
            "load_optimizer_states=False"
        )
    missing = [n for g in saved_groups for n in g["params"] if n not in known_names]
    if missing:
        raise CheckpointError(
            f"the checkpoint's optimizer holds state for parameters this model lacks: {missing[:5]}; "
            "load with load_optimizer_states=False to take only the weights"
        )


def load_per_param_state_by_name(optimizer, names: dict[torch.Tensor, str], saved: dict) -> None:
    """Load the named form into an optimizer that updates one tensor per parameter."""
    name_to_index, current, index = {}, [], 0
    for group in optimizer.param_groups:
        current.append(list(range(index, index + len(group["params"]))))
        for p in group["params"]:
            name_to_index[names.get(p, f"unnamed.{index}")] = index
            index += 1
    check_groups(saved, optimizer, name_to_index)
    # contiguous copies: the saved tensors may map a checkpoint file (read_tensors(mmap=True))
    # or be strided views of one (a tensor-parallel slice)
    state = {
        name_to_index[n]: {
            k: v.clone(memory_format=torch.contiguous_format) if isinstance(v, torch.Tensor) else v
            for k, v in s.items()
        }
        for n, s in saved["state"].items()
    }
    # torch pairs saved and current parameters by position, so list them in this optimizer's
    # order (the saved order is another layout's); the options come from the checkpoint
    groups = [{**g, "params": indices} for g, indices in zip(saved["param_groups"], current)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    with torch.no_grad():
        for p, name in names.items():
            if name in saved.get("master", {}):
                p.copy_(saved["master"][name])
