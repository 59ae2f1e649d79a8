"""Tensor-parallel inference: split a model over the tensor group with the training
AutoTP policies (``shardwise.tensor_parallel.policies``).

Attention and MLP layers are split as in training (column-parallel in, row-parallel out,
one all-reduce per block); the LM head is split by vocabulary and its logits gathered, so
every rank computes a ``1/tp`` slice of the largest matmul of a decode step and ends with
the same full logits. The input embedding stays whole on every rank.
"""

from __future__ import annotations

import logging
import re

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config._errors import ConfigError
from shardwise.tensor_parallel.autotp import _set_submodule, apply_autotp, resolve_policy
from shardwise.tensor_parallel.layers import ColumnParallelLinear
from shardwise.tensor_parallel.policies import POLICIES, TPPolicy

logger = logging.getLogger("shardwise")


def tensor_comm(tp_size: int, group=None):
    """The Communicator of this rank's tensor group: ``group`` if given (a process group,
    an mpu or a grid), else consecutive blocks of ``tp_size`` ranks of the world."""
    from shardwise.parallel import ParallelGrid
    from shardwise.tensor_parallel import as_tensor_comm

    if group is not None:
        comm = as_tensor_comm(group)
        if tp_size not in (1, comm.world_size):
            raise ConfigError(
                f"tensor_parallel.tp_size is {tp_size} but the tensor-parallel group given has "
                f"{comm.world_size} ranks; make them agree"
            )
        return comm
    if not dist.is_initialized():
        from shardwise.comm import init_distributed

        init_distributed()
    world = dist.get_world_size()
    if world % tp_size:
        raise ConfigError(
            f"tensor_parallel.tp_size {tp_size} does not divide the {world} ranks of the job; start "
            f"a multiple of {tp_size} processes (shardwise run --num_gpus N, torchrun --nproc-per-node N)"
        )
    return ParallelGrid.build(tensor=tp_size).tensor_comm


def inference_policy(model: nn.Module, injection_policy: dict | None) -> TPPolicy:
    """The sharding policy: from ``injection_policy`` when given, else the built-in one of
    the model's family; an unknown model without one is refused, naming its classes."""
    if injection_policy:
        return _policy_from_injection(model, injection_policy)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in POLICIES and not getattr(config, "base_model_tp_plan", None):
        blocks = sorted(
            {type(m).__name__ for m in model.modules() if isinstance(m, nn.ModuleList) for m in m.children()}
        )
        raise ConfigError(
            f"no tensor-parallel policy for {type(model).__name__} (model_type {model_type!r}); "
            f"built-in: {sorted(POLICIES)}. Its module classes include {blocks or ['?']}. Pass "
            "injection_policy={BlockClass: ('attn.out_proj', 'mlp.fc2')} naming, per block class, "
            "the linear layers whose outputs are summed across ranks"
        )
    return resolve_policy(model)


def _policy_from_injection(model: nn.Module, injection_policy: dict) -> TPPolicy:
    """DeepSpeed's ``injection_policy``: per module class, the linear layers whose outputs
    are reduced (row-parallel); the other linear layers of those modules are split by
    output columns."""
    column, row, found = [], [], set()
    for name, module in model.named_modules():
        rows = next(
            (
                names
                for cls, names in injection_policy.items()
                if (type(module) is cls if isinstance(cls, type) else type(module).__name__ == cls)
            ),
            None,
        )
        if rows is None:
            continue
        found.add(type(module).__name__)
        rows = (rows,) if isinstance(rows, str) else tuple(rows)
        for child_name, child in module.named_modules():
            if not child_name or not (isinstance(child, nn.Linear) or type(child).__name__ == "Conv1D"):
                continue
            full = re.escape(f"{name}.{child_name}" if name else child_name)
            matched = any(child_name == r or child_name.endswith("." + r) for r in rows)
            (row if matched else column).append(full)
    if not found:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(
            f"injection_policy names {[getattr(c, '__name__', c) for c in injection_policy]}, but "
            f"the model has no module of those classes; its classes are {classes}"
        )
    if not row:
        raise ConfigError(
            f"injection_policy: none of the names {list(injection_policy.values())} is a linear layer "
            f"inside {sorted(found)}; name the layers whose outputs are summed (attention output, "
            "MLP output)"
        )
    return TPPolicy("injection_policy", column=tuple(column), row=tuple(row), head_counts=())


def check_divisible(model: nn.Module, tp: int) -> None:
    """Refuse a ``tp`` that splits a head, a key-value head or the vocabulary, by name."""
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "n_head", "num_key_value_heads", "vocab_size"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value % tp:
            what = {
                "vocab_size": "the vocabulary (vocab_size)",
                "num_key_value_heads": "the key-value heads (num_key_value_heads)",
            }.get(attr, f"the attention heads ({attr})")
            raise ConfigError(
                f"tensor_parallel.tp_size {tp} does not divide {what} = {value}; each rank must "
                f"hold whole heads and an equal share of the vocabulary: choose a tp_size dividing "
                f"{value}"
            )


def shard_model(model: nn.Module, comm, policy: TPPolicy) -> None:
    """Split ``model`` in place over ``comm``'s tensor group (LM head by vocabulary)."""
    tp = comm.world_size
    check_divisible(model, tp)
    apply_autotp(model, comm, policy=policy)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear):
        name = next(n for n, m in model.named_modules() if m is head)
        if head.out_features % tp:
            raise ConfigError(
                f"tensor_parallel.tp_size {tp} does not divide the LM head's {head.out_features} "
                "output features (the vocabulary); choose a tp_size dividing it"
            )
        layer = ColumnParallelLinear._from_full(head.weight, head.bias, group=comm, gather_output=True)
        layer.requires_grad_(False)
        _set_submodule(model, name, layer)


def log_placement(model: nn.Module, tp: int, dtype: torch.dtype) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        held = sum(p.numel() for p in model.parameters())
        logger.info(
            "init_inference: %s split %d ways, %.1fM parameters held per rank, %s",
            type(model).__name__,
            tp,
            held / 1e6,
            dtype,
        )
