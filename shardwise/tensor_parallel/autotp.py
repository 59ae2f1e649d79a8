"""Training AutoTP: split a Hugging Face ``transformers`` model across the tensor group.

``"tensor_parallel": {"autotp_size": N}`` makes :func:`shardwise.initialize` call
:func:`apply_autotp` on the model before ZeRO sees it: the layers the family's policy
names (see [Note: sharding policies] in ``policies.py``) are replaced by column- and
row-parallel layers holding this rank's shard, attention modules are told their per-rank
head counts, and a check on the first forward makes sure every rank of a tensor group
got the same batch (the engine's data loader gives them the same one; a loop that
indexes data by global rank would not). ZeRO then partitions the shards over the
data-parallel group like any other parameters.

[Note: stacked and transposed weights]
GPT-2 stores ``Conv1D`` weights transposed (``[in, out]``) and stacks query, key and
value in one output (``c_attn``). The parallel layers hold ``[out, in]`` weights, and a
stacked output is split block by block: the full output's columns are reordered so that
rank ``r``'s query, key and value heads are contiguous, then cut into equal chunks. The
parameter records both facts (``tensor_parallel_transposed``, and ``partition_stride``
= the number of blocks) so that the full Hugging Face tensor can be rebuilt from the
shards (:func:`full_tensor`).
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from shardwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardwise.tensor_parallel.policies import POLICIES, TPPolicy, policy_from_hf_tp_plan, policy_from_layer_specs

logger = logging.getLogger("shardwise")


def resolve_policy(model: nn.Module, section: dict | None = None) -> TPPolicy:
    """The policy for ``model``: ``preset_model``, else the built-in one for
    ``model.config.model_type``, else the model's Hugging Face ``base_model_tp_plan``;
    the config's ``partition_config.layer_specs`` are added to it, or replace it when
    ``use_default_specs`` is false (DeepSpeed's rules)."""
    section = section or {}
    partition = section.get("partition_config") or {}
    preset = section.get("preset_model")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    specs = partition.get("layer_specs")
    if specs and not partition.get("use_default_specs", True):  # DeepSpeed merges with the built-in specs by default
        return policy_from_layer_specs(specs, name="tensor_parallel.partition_config", model_type=model_type)
    base = None
    if preset is not None:
        if preset not in POLICIES:
            raise ValueError(
                f"tensor_parallel.preset_model={preset!r} is not a known preset; shardwise has "
                f"{sorted(POLICIES)} (or give partition_config.layer_specs)"
            )
        base = POLICIES[preset]
    elif model_type in POLICIES:
        base = POLICIES[model_type]
    else:
        plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
        if plan:
            prefix = getattr(model, "base_model_prefix", "")
            prefix = prefix if prefix and hasattr(model, prefix) else ""
            base = policy_from_hf_tp_plan(plan, prefix=prefix)
    if specs:  # use_default_specs: the user's specs extend the default policy
        extra = policy_from_layer_specs(specs, name="tensor_parallel.partition_config", model_type=model_type)
        if base is None:
            return extra
        return TPPolicy(
            f"{base.name}+partition_config",
            column=base.column + extra.column,
            row=base.row + extra.row,
            fused={**base.fused, **extra.fused},
            head_attrs=base.head_attrs,
            head_counts=base.head_counts,
            shared_inputs=base.shared_inputs,
        )
    if base is None:
        linears = sorted(
            {type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}
        )
        blocks = sorted(
            {type(m).__name__ for m in model.modules() if isinstance(m, nn.ModuleList) for m in m.children()}
        )
        raise ValueError(
            f"AutoTP has no sharding policy for {type(model).__name__} (model_type {model_type!r}); "
            f"built-in: {sorted(POLICIES)}. Its blocks are {blocks or ['?']} with layers of "
            f'{linears}. Name the layers to split in the config: "tensor_parallel": '
            '{"autotp_size": N, "partition_config": {"layer_specs": [{"patterns": '
            '[".*\\\\.out_proj\\\\.weight$"], "partition_type": "row"}, {"patterns": '
            '[".*\\\\.in_proj\\\\.weight$"], "partition_type": "column"}]}}'
        )
    return base


def apply_autotp(model: nn.Module, comm, *, policy: TPPolicy) -> dict[nn.Parameter, nn.Parameter]:
    """Replace the layers ``policy`` names by this rank's tensor-parallel shards, in place.
    ``comm`` is the tensor group's Communicator. Returns each replaced parameter's
    successor (so optimizers built on the full model can be pointed at the shards)."""
    tp = comm.world_size
    _check_head_counts(model, policy, tp)
    replaced = {"column": 0, "row": 0}
    successors: dict[nn.Parameter, nn.Parameter] = {}
    for name, module in list(model.named_modules()):
        kind = policy.kind(name)
        if kind is None:
            continue
        replaced[kind] += 1
        layer = _shard(module, name, kind, comm, blocks=policy.blocks(name))
        successors.update(
            (old, new) for old, new in ((module.weight, layer.weight), (module.bias, layer.bias)) if old is not None
        )
        _set_submodule(model, name, layer)
    if not any(replaced.values()):
        raise ValueError(
            f"AutoTP policy {policy.name!r} matched no layer of {type(model).__name__}; check its "
            "patterns against the module names (print(model) shows them)"
        )
    for module in model.modules():
        for attr in policy.head_attrs.get(type(module).__name__, ()):
            value = getattr(module, attr)
            if value % tp:
                raise ValueError(f"{type(module).__name__}.{attr}={value} does not divide by autotp_size {tp}")
            setattr(module, attr, value // tp)
    if tp > 1:
        _share_input_regions(model, policy, comm)
        check = _SameBatchCheck(comm)
        check.handle = model.register_forward_pre_hook(check, with_kwargs=True, prepend=True)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        logger.info(
            "AutoTP (%s): %d column- and %d row-parallel layers split %d ways",
            policy.name,
            replaced["column"],
            replaced["row"],
            tp,
        )
    return successors


def _share_input_regions(model: nn.Module, policy: TPPolicy, comm) -> None:
    """[Note: one input region for sibling layers]
    Attention's query, key and value projections (and the MLP's gate and up) read the same
    input. Each column-parallel layer puts its input into the tensor region itself, which
    all-reduces that input's gradient in backward: three all-reduces of the same shape for
    q/k/v, two for gate/up. For a module the policy names in ``shared_inputs`` (its input
    is read by its column-parallel children only), the input enters the region once, in a
    forward pre-hook, and the children skip theirs: autograd sums the children's input
    gradients first and one all-reduce carries the sum (15 -> 9 all-reduces per step on a
    2-layer Llama, bench/results/2026-11-25-cpu-tensor-parallel.md)."""
    from shardwise.tensor_parallel.mappings import copy_to_tensor_region

    for name, module in model.named_modules():
        if not any(re.fullmatch(p, name) for p in policy.shared_inputs):
            continue
        children = [m for m in module.modules() if isinstance(m, ColumnParallelLinear) and not m.sequence_parallel]
        if len(children) < 2:
            continue
        for child in children:
            child.input_in_region = True

        def enter_region(mod, args, kwargs):
            if "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states": copy_to_tensor_region(kwargs["hidden_states"], comm)}
            elif args:
                args = (copy_to_tensor_region(args[0], comm), *args[1:])
            return args, kwargs

        module.register_forward_pre_hook(enter_region, with_kwargs=True)


def _check_head_counts(model: nn.Module, policy: TPPolicy, tp: int) -> None:
    config = getattr(model, "config", None)
    for attr in policy.head_counts:
        value = getattr(config, attr, None)
        if value is not None and value % tp:
            raise ValueError(
                f"autotp_size {tp} does not divide the model's {attr} ({value}): each tensor rank must "
                "hold whole attention heads; choose an autotp_size that divides it"
            )


def _shard(module: nn.Module, name: str, kind: str, comm, *, blocks: int) -> nn.Module:
    is_conv1d = type(module).__name__ == "Conv1D"  # Hugging Face GPT-2's transposed linear
    if not (isinstance(module, nn.Linear) or is_conv1d):
        raise ValueError(
            f"AutoTP: {name} is a {type(module).__name__}, not a linear layer; only nn.Linear and "
            "Hugging Face Conv1D layers can be split"
        )
    weight = module.weight.t() if is_conv1d else module.weight  # [out, in]
    bias = module.bias
    tp = comm.world_size
    if kind == "column" and blocks > 1:
        weight, bias = _interleave_blocks(weight, bias, blocks=blocks, tp=tp, name=name)
    layer_type = ColumnParallelLinear if kind == "column" else RowParallelLinear
    options = {"gather_output": False} if kind == "column" else {"input_is_parallel": True}
    try:
        layer = layer_type._from_full(weight, bias, group=comm, **options)
    except ValueError as exc:
        raise ValueError(f"AutoTP cannot split {name}: {exc}") from None
    for param, source in ((layer.weight, module.weight), (layer.bias, module.bias)):
        if param is None:
            continue
        param.requires_grad_(source.requires_grad)  # a frozen layer stays frozen, a trained one trains
        if getattr(param, "tensor_model_parallel", False):
            param.partition_stride = blocks if kind == "column" else 1
    if is_conv1d:
        layer.weight.tensor_parallel_transposed = True
    return layer


def _interleave_blocks(weight: torch.Tensor, bias: torch.Tensor | None, *, blocks: int, tp: int, name: str):
    """Reorder the output rows of a stacked ``[blocks * B, in]`` weight so that chunk ``r``
    of ``tp`` holds block 0's ``r``-th slice, then block 1's... (see [Note: stacked and
    transposed weights])."""
    out = weight.shape[0]
    if out % (blocks * tp):
        raise ValueError(
            f"AutoTP cannot split {name}: its {out} output features hold {blocks} blocks, which do not "
            f"split into {tp} equal parts each"
        )
    order = torch.arange(out).reshape(blocks, tp, out // (blocks * tp)).transpose(0, 1).reshape(-1)
    with torch.no_grad():
        return weight[order], (bias[order] if bias is not None else None)


def full_tensor(shards: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """The full Hugging Face tensor from every tensor rank's shard of ``param`` (in rank
    order), undoing the block interleave and the transposition."""
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    if stride > 1:
        pieces = [s.chunk(stride, dim=dim) for s in shards]
        full = torch.cat([piece[b] for b in range(stride) for piece in pieces], dim=dim)
    else:
        full = torch.cat(shards, dim=dim)
    return full.t() if getattr(param, "tensor_parallel_transposed", False) else full


class _SameBatchCheck:
    """On the first forward, check that every rank of the tensor group got the same inputs
    (tensor ranks compute one model on one batch), then remove itself."""

    def __init__(self, comm):
        self.comm = comm
        self.handle = None

    def __call__(self, module, args, kwargs):
        tensors = list(_tensors((args, kwargs)))
        summary = torch.tensor(
            [
                float(sum(t.numel() for t in tensors)),
                float(sum(t.detach().double().sum() for t in tensors)) if tensors else 0.0,
                float(
                    sum((t.detach().double() * (1 + torch.arange(t.numel()).reshape(t.shape))).sum() for t in tensors)
                )
                if tensors
                else 0.0,
            ],
            dtype=torch.float64,
            device=tensors[0].device if tensors else None,
        )
        low, high = summary.clone(), summary.clone()
        self.comm.all_reduce(low, op=torch.distributed.ReduceOp.MIN, tag="AutoTP same-batch check").wait()
        self.comm.all_reduce(high, op=torch.distributed.ReduceOp.MAX, tag="AutoTP same-batch check").wait()
        self.handle.remove()
        if not torch.equal(low, high):
            raise ValueError(
                "the ranks of a tensor-parallel group were given different inputs: with tensor "
                "parallelism every rank of a tensor group computes one model on one batch. Feed data "
                "by data-parallel rank (engine.grid.get_data_parallel_rank() and "
                "get_data_parallel_world_size(), or the loader initialize(training_data=...) returns), "
                "not by global rank"
            )
        return None


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)
