"""``deepspeed.compression.compress``: :func:`init_compression` swaps the ``nn.Linear`` layers
the config names for :class:`CompressedLinear` (the ``nn.Conv2d`` layers of channel pruning,
weight quantization and sparse pruning for :class:`CompressedConv2d`; sparse pruning's
``snip_momentum`` takes every ``nn.Linear`` and ``nn.Conv2d`` outside ``excluded_modules``); the engine
advances them with the training step (``scheduler.CompressionFeature``);
:func:`redundancy_clean` then folds the techniques into the weights and removes pruned
rows, heads and channels.

Module patterns are matched as DeepSpeed matched them: ``re.search(pattern, name)`` over the
names of ``model.named_modules()``, keeping ``nn.Linear`` layers (``nn.Conv2d`` layers for
channel pruning, both for weight quantization and sparse pruning).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from shardwise.compression._clean import (
    GROUPED_CONV_PROBLEM,
    channel_fit_problem,
    clean_layer,
    shrink_after_channels,
    shrink_related,
)
from shardwise.compression._conv import ChannelMaskedBatchNorm2d, CompressedConv2d
from shardwise.compression._layers import (
    ActivationQuantization,
    CompressedLinear,
    Pruning,
    WeightQuantization,
)
from shardwise.compression._quantizers import QuantSpec
from shardwise.compression._snip_momentum import SnipSchedule, check_block_fits, snip_layer_names
from shardwise.config._compression import CompressionConfig, CompressionGroup, TechniqueConfig, compression_config
from shardwise.utils._modules import recursive_getattr, recursive_setattr

__all__ = ["convert_conv1d_to_linear", "init_compression", "redundancy_clean", "student_initialization"]


def _read_config(deepspeed_config: Any) -> CompressionConfig:
    """The ``compression_training`` section of a config dict or JSON file path."""
    if isinstance(deepspeed_config, (str, os.PathLike)):
        if not os.path.exists(deepspeed_config):
            raise ValueError(f"expected a DeepSpeed config dict or the path of one, got {deepspeed_config!r}")
        with open(deepspeed_config) as handle:
            deepspeed_config = json.load(handle)
    if not isinstance(deepspeed_config, Mapping):
        raise ValueError(f"expected a DeepSpeed config dict or the path of one, got {type(deepspeed_config).__name__}")
    return compression_config(deepspeed_config.get("compression_training"))


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


def _check_mpu(mpu) -> None:
    if mpu is not None:
        raise NotImplementedError(
            "compression of tensor-parallel layers (mpu=...) is not available in this version of shardwise; "
            "compress the model before sharding it, or pass mpu=None"
        )


_CHANNEL_RELATED = (nn.BatchNorm2d, nn.Conv2d, nn.Linear)


def _kind_names(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(f"nn.{k.__name__}" for k in kinds)


def match_modules(model: nn.Module, pattern: str, where: str, kind: type | tuple[type, ...] = nn.Linear) -> list[str]:
    """The names of ``model``'s ``kind`` layers (``nn.Linear`` by default) that
    ``re.search(pattern, name)`` finds.

    Raises:
        ValueError: the pattern is not a regular expression, or matches no ``kind`` layer.
    """
    try:
        compiled = re.compile(pattern)
    except re.error as error:
        raise ValueError(f"{where}: {pattern!r} is not a valid regular expression ({error})") from None
    names = [name for name, m in model.named_modules() if isinstance(m, kind) and compiled.search(name)]
    if not names:
        others = [name for name, m in model.named_modules() if name and compiled.search(name)]
        found = f" (it matches {', '.join(others[:3])}, which are not {_kind_names(kind)})" if others else ""
        raise ValueError(f"{where}: the pattern {pattern!r} matches no {_kind_names(kind)} module of the model{found}")
    return names


_CONV_TOO = ("weight_quantization", "sparse_pruning")
"""The techniques that take ``nn.Conv2d`` layers as well as ``nn.Linear`` ones."""


def _refuse_other_layers(model: nn.Module, pattern: str, technique: str, where: str) -> None:
    """A pattern must not name a layer its technique is not built for: channel pruning
    prunes only ``nn.Conv2d`` layers; row, head pruning and activation quantization do not
    take ``nn.Conv2d`` layers (DeepSpeed compressed them; skipping them silently would leave
    them as they were)."""
    compiled = re.compile(pattern)
    for name, module in model.named_modules():
        if not name or not compiled.search(name):
            continue
        if technique == "channel_pruning":
            if not isinstance(module, nn.Conv2d) and next(module.parameters(recurse=False), None) is not None:
                raise ValueError(
                    f"{where}: the pattern {pattern!r} matches {name!r}, a {type(module).__name__}; channel "
                    "pruning prunes nn.Conv2d output channels only (row_pruning prunes nn.Linear rows): "
                    "narrow the pattern to the convolutions"
                )
        elif isinstance(module, nn.Conv2d) and technique not in _CONV_TOO:
            raise ValueError(
                f"{where}: the pattern {pattern!r} matches {name!r}, an nn.Conv2d; {technique} of nn.Conv2d "
                "layers is not available in this version of shardwise (channel_pruning, weight_quantization "
                "and sparse_pruning are): narrow the pattern to the nn.Linear layers"
            )


def group_modules(model: nn.Module, technique: TechniqueConfig) -> Iterator[tuple[CompressionGroup, int, list[str]]]:
    """(group, pattern index, matched names) for each pattern of each group of ``technique``.

    Raises:
        ValueError: a pattern matches nothing, matches a layer the technique does not take,
            or a module is matched twice by the technique.
    """
    kind = nn.Conv2d if technique.name == "channel_pruning" else nn.Linear
    if technique.name in _CONV_TOO:
        kind = (nn.Linear, nn.Conv2d)
    seen: dict[str, str] = {}
    for group in technique.groups:
        for index, pattern in enumerate(group.modules):
            where = f"compression_training.{technique.name}.different_groups.{group.name}.modules"
            names = match_modules(model, pattern, where, kind)
            _refuse_other_layers(model, pattern, technique.name, where)
            for name in names:
                if name in seen:
                    raise ValueError(
                        f"{where}: module {name!r} is already compressed by {technique.name} group {seen[name]!r}"
                    )
                seen[name] = group.name
            yield group, index, names


def related_names(
    model: nn.Module, technique: str, group: CompressionGroup, index: int, names: list[str]
) -> list[list[str]]:
    """For each ``related_modules`` pattern of the group's pattern ``index``, the names it
    matches, paired in order with ``names`` (the pattern's own matches).

    Raises:
        ValueError: a related pattern matches nothing or a different number of modules.
    """
    where = f"compression_training.{technique}.different_groups.{group.name}"
    related = group.related_modules[index] if group.related_modules else ()
    kind = _CHANNEL_RELATED if technique == "channel_pruning" else nn.Linear
    found = [match_modules(model, p, f"{where}.related_modules", kind) for p in related]
    for names_of_pattern in found:
        if len(names_of_pattern) != len(names):
            raise ValueError(
                f"{where}: a related_modules pattern matches {len(names_of_pattern)} modules but "
                f"its module pattern matches {len(names)}; they are paired in order"
            )
    return found


def _channel_related_pairs(
    model: nn.Module, group: CompressionGroup, index: int, names: list[str]
) -> list[tuple[str, str]]:
    """(pruned convolution, related module) name pairs of a channel-pruning group's
    pattern ``index``, checked to fit before anything is replaced.

    Raises:
        ValueError: a related module that cannot lose the convolution's channels.
    """
    where = f"compression_training.channel_pruning.different_groups.{group.name}.related_modules"
    pairs = []
    for names_of_pattern in related_names(model, "channel_pruning", group, index, names):
        for name, related in zip(names, names_of_pattern, strict=True):
            conv, layer = recursive_getattr(model, name), recursive_getattr(model, related)
            if conv.groups != 1:
                raise ValueError(f"{where}: {name!r}: {GROUPED_CONV_PROBLEM.format(conv.groups)}")
            problem = channel_fit_problem(layer, conv.out_channels)
            if problem is not None:
                raise ValueError(f"{where}: {related!r} cannot follow the pruned {name!r}: {problem}")
            pairs.append((name, related))
    return pairs


def _weight_groups(shared: Mapping, layer: nn.Linear, where: str) -> int:
    """``quantize_groups``, or with ``quantize_group_size`` (columns per group) the count
    that gives each row ``in_features / quantize_group_size`` groups."""
    size = shared.get("quantize_group_size")
    if size is None:
        return shared["quantize_groups"]
    if isinstance(layer, nn.Conv2d):
        raise ValueError(
            f"{where}: quantize_group_size (groups of input columns) is for nn.Linear layers; a pattern "
            "matches an nn.Conv2d: use quantize_groups, or narrow the patterns to the nn.Linear layers"
        )
    if layer.in_features % size:
        raise ValueError(
            f"{where}: quantize_group_size={size} does not divide the {layer.in_features} input features of a "
            "matched layer; pick a divisor of every matched layer's in_features"
        )
    return layer.out_features * (layer.in_features // size)


def _weight_spec(shared: Mapping, params: Mapping, groups: int) -> WeightQuantization:
    grid = QuantSpec(
        bits=params["target_bits"],
        groups=groups,
        symmetric=shared["quantization_type"] == "symmetric",
        stochastic=shared["rounding"] == "stochastic",
    )
    return WeightQuantization(
        start_bits=params["start_bits"],
        target_bits=params["target_bits"],
        period=params["quantization_period"],
        offset=shared["schedule_offset"],
        in_forward=shared["quantize_weight_in_forward"],
        grid=grid,
    )


def _enable(layer: CompressedLinear | CompressedConv2d, technique: TechniqueConfig, params: Mapping) -> None:
    shared = technique.shared
    if technique.name == "weight_quantization":
        groups = _weight_groups(shared, layer, "compression_training.weight_quantization.shared_parameters")
        layer.enable_weight_quantization(_weight_spec(shared, params, groups))
    elif technique.name == "activation_quantization":
        layer.enable_activation_quantization(
            ActivationQuantization(
                bits=params["bits"],
                symmetric=shared["quantization_type"] == "symmetric",
                static=shared["range_calibration"] == "static",
                offset=shared["schedule_offset"],
            )
        )
    else:
        spec = Pruning(
            method=shared["method"],
            ratio=params["dense_ratio"],
            offset=shared["schedule_offset"],
            num_heads=shared.get("num_heads", 0),
        )
        getattr(layer, f"enable_{technique.name}")(spec)


def init_compression(model: nn.Module, deepspeed_config, teacher_model: nn.Module | None = None, mpu=None) -> nn.Module:
    """Replace the ``nn.Linear`` layers that ``compression_training`` names by
    :class:`CompressedLinear` (sharing their parameters) and enable each technique on them;
    channel pruning, weight quantization and sparse pruning do the same for ``nn.Conv2d``
    layers with :class:`CompressedConv2d`, sparse pruning's ``snip_momentum`` for every
    ``nn.Linear`` and ``nn.Conv2d`` outside ``excluded_modules`` (see [Note: snip_momentum schedule]), and
    channel pruning makes the BatchNorms of its ``related_modules`` mask the pruned
    channels too (see [Note: channel pruning and BatchNorm]). Call it before ``initialize`` (topk pruning adds
    score parameters the optimizer must see); the engine then advances the schedule (see
    [Note: compression schedule]).

    Args:
        model: the model (or an engine / wrapper with ``.module``); changed in place.
        deepspeed_config: the config dict or the path of its JSON file.
        teacher_model: the teacher for layer reduction.
        mpu: must be None (tensor-parallel layers are not compressed).

    Returns:
        ``model``.

    Raises:
        ConfigError: a bad ``compression_training`` section.
        ValueError: a pattern that matches no ``nn.Linear`` (channel pruning: no
            ``nn.Conv2d``) or matches a layer its technique does not take, a module named
            twice by one technique, a technique the matched layer cannot take (quantize_groups
            that do not divide the weight, num_heads that do not divide in_features,
            quantize_group_size on an nn.Conv2d, a snip_momentum block pattern that does not
            tile a weight, another convolution snip_momentum would take), or a channel-pruning
            related module that does not fit its convolution.
    """
    _check_mpu(mpu)
    config = _read_config(deepspeed_config)
    target = _unwrap(model)
    if config.layer_reduction.enabled:
        if teacher_model is None:
            raise ValueError("compression_training.layer_reduction is enabled: pass teacher_model")
        student_initialization(target, teacher_model, deepspeed_config)
    for technique in config.techniques():
        if not technique.enabled:
            continue
        if _is_snip(technique):
            _init_snip_momentum(target, technique.shared)
        for group, index, names in group_modules(target, technique):
            pairs = _channel_related_pairs(target, group, index, names) if technique.name == "channel_pruning" else []
            for name in names:
                layer = _compressed(recursive_getattr(target, name))
                _enable(layer, technique, group.params)
                recursive_setattr(target, name, layer)
            for name, related in pairs:  # see [Note: channel pruning and BatchNorm]
                norm = recursive_getattr(target, related)
                if isinstance(norm, nn.BatchNorm2d):
                    recursive_setattr(
                        target, related, ChannelMaskedBatchNorm2d.after(norm, recursive_getattr(target, name))
                    )
    return model


def _is_snip(technique: TechniqueConfig) -> bool:
    return technique.name == "sparse_pruning" and technique.shared["method"] == "snip_momentum"


def _compressed(module: nn.Module) -> CompressedLinear | CompressedConv2d:
    if isinstance(module, nn.Conv2d):
        return CompressedConv2d.from_conv(module)
    return CompressedLinear.from_linear(module)


def _init_snip_momentum(model: nn.Module, shared: Mapping) -> None:
    """Every nn.Linear and nn.Conv2d outside ``excluded_modules`` becomes a compressed layer
    pruned by snip_momentum (see [Note: snip_momentum schedule])."""
    schedule = SnipSchedule.from_shared(shared)
    names = snip_layer_names(model, list(shared["excluded_modules"]))
    for name in names:
        check_block_fits(recursive_getattr(model, name), schedule.pattern, name)
    spec = Pruning(method="snip_momentum", ratio=schedule.dense_ratio, offset=schedule.offset, schedule=schedule)
    for name in names:
        layer = _compressed(recursive_getattr(model, name))
        layer.enable_sparse_pruning(spec)
        recursive_setattr(model, name, layer)


def redundancy_clean(model: nn.Module, deepspeed_config, mpu=None) -> nn.Module:
    """Fold the compression into the weights: quantized weights are written at
    ``target_bits``, pruned weights are zeroed, and where a group names
    ``related_modules`` the pruned rows (row pruning), heads (head pruning) or output
    channels (channel pruning) are removed, with the matching input columns of the related
    layers (Q/K/V's rows for heads; for channels the BatchNorm2d's features, the next
    Conv2d's input channels or an nn.Linear's input features). The layers keep activation
    quantization. The result computes what the compressed model computed at the end of the
    schedule, with fewer parameters.

    Raises:
        ValueError: the layers were not prepared by :func:`init_compression`, or a related
            pattern matches a different number of modules than its module pattern, or a
            related module that does not fit.
    """
    _check_mpu(mpu)
    config = _read_config(deepspeed_config)
    target = _unwrap(model)
    for technique in config.techniques():
        if not technique.enabled or technique.name == "activation_quantization":
            continue
        compressed = CompressedConv2d if technique.name == "channel_pruning" else CompressedLinear
        if technique.name in _CONV_TOO:
            compressed = (CompressedLinear, CompressedConv2d)
        if _is_snip(technique):
            for name in snip_layer_names(target, list(technique.shared["excluded_modules"])):
                layer = recursive_getattr(target, name)
                if not isinstance(layer, (CompressedLinear, CompressedConv2d)):
                    raise ValueError(
                        f"compression_training.sparse_pruning: {name!r} is not compressed; call init_compression first"
                    )
                clean_layer(layer, "sparse_pruning", shrink=False)
        for group, index, names in group_modules(target, technique):
            where = f"compression_training.{technique.name}.different_groups.{group.name}"
            for name in names:
                if not isinstance(recursive_getattr(target, name), compressed):
                    raise ValueError(f"{where}: {name!r} is not compressed; call init_compression first")
            related = related_names(target, technique.name, group, index, names)
            for j, name in enumerate(names):
                kept = clean_layer(recursive_getattr(target, name), technique.name, shrink=bool(related))
                for names_of_pattern in related:
                    _shrink(target, names_of_pattern[j], technique.name, kept)
    return model


def _shrink(model: nn.Module, name: str, technique: str, kept: torch.Tensor | None) -> None:
    layer = recursive_getattr(model, name)
    if technique != "channel_pruning":
        shrink_related(layer, technique, kept)
    elif kept is not None:
        recursive_setattr(model, name, shrink_after_channels(layer, kept))


def student_initialization(student_model: nn.Module, teacher_model: nn.Module, deepspeed_config) -> None:
    """Copy the teacher layers ``layer_reduction.teacher_layer`` into the student's layers
    0, 1, ... under ``module_name_prefix``, and the ``other_module_name`` modules whole.

    Raises:
        ValueError: a teacher layer the teacher does not have, more teacher layers than the
            student has, or modules whose parameter shapes differ.
    """
    from shardwise.compression._layer_reduction import copy_teacher_layers

    copy_teacher_layers(student_model, teacher_model, _read_config(deepspeed_config).layer_reduction)


@torch.no_grad()
def convert_conv1d_to_linear(model: nn.Module, convert_type: type) -> nn.Module:
    """Replace every ``convert_type`` module (transformers' ``Conv1D``: a ``(in, out)``
    weight) by the ``nn.Linear`` computing the same, so the compression patterns can
    name it (GPT-2's ``c_attn``, ``c_fc``...). Returns ``model``, changed in place."""
    target = _unwrap(model)
    for name, module in list(target.named_modules()):
        if isinstance(module, convert_type):
            fan_in, fan_out = module.weight.shape
            linear = nn.Linear(fan_in, fan_out, bias=module.bias is not None, device="meta")
            linear.weight = nn.Parameter(module.weight.t().contiguous(), requires_grad=module.weight.requires_grad)
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.reshape(-1).clone(), requires_grad=module.bias.requires_grad)
            recursive_setattr(target, name, linear)
    return model
