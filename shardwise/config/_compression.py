"""DeepSpeed's ``compression_training`` section, with the keys and defaults of DeepSpeed's
last compression library (0.16 - 0.18): one entry per technique, each with
``shared_parameters`` and ``different_groups.<name>.{params, modules, related_modules}``.
Read by ``shardwise/compression/``.

Built: weight quantization, activation quantization, sparse pruning (l1, topk and
``snip_momentum``, Intel Neural Compressor's pruner that DeepSpeed called: its keys
``dense_ratio``, ``block_pattern`` ("NxM" blocks or "N:M" groups; channel patterns refused
by name), ``schedule_offset``, ``schedule_offset_stride``, ``schedule_offset_end`` and
``excluded_modules`` live in ``shared_parameters``, and it takes no ``different_groups``),
row pruning, head pruning, channel pruning (Conv2d output channels; l1, topk) and layer
reduction. Parsed but refused by name when enabled: weight quantization's
``fp16_mixed_quantize``. Weight quantization and sparse pruning take ``nn.Linear``
and ``nn.Conv2d`` layers, channel pruning ``nn.Conv2d`` only, the other techniques
``nn.Linear`` only (``init_compression`` refuses a pattern naming another layer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from shardwise.config._errors import ConfigError, as_bool, as_choice, as_int, as_number, check_keys

TECHNIQUES = (
    "weight_quantization",
    "activation_quantization",
    "sparse_pruning",
    "row_pruning",
    "head_pruning",
    "channel_pruning",
)
"""The techniques that replace layers, in the order ``redundancy_clean`` fixes them."""

# technique -> {shared key: default}; None marks a key with no default (needed when enabled)
_SHARED: dict[str, dict[str, Any]] = {
    "weight_quantization": {
        "enabled": False,
        "quantizer_kernel": False,
        "schedule_offset": 0,
        "quantize_groups": 1,
        "quantize_verbose": False,
        "quantization_type": "symmetric",
        "rounding": "nearest",
        "quantize_weight_in_forward": False,
        "fp16_mixed_quantize": {},
        "quantize_group_size": None,  # shardwise: groups of N input columns (ZeroQuant), instead of quantize_groups
    },
    "activation_quantization": {
        "enabled": False,
        "quantization_type": "symmetric",
        "range_calibration": "dynamic",
        "schedule_offset": 1000,
    },
    "sparse_pruning": {
        "enabled": False,
        "method": "l1",
        "schedule_offset": 1000,
        "schedule_offset_end": None,
        "schedule_offset_stride": 1,
        "block_pattern": "4x1",
        "dense_ratio": 0.1,
        "excluded_modules": [],
    },
    "row_pruning": {"enabled": False, "method": "l1", "schedule_offset": 1000},
    "head_pruning": {"enabled": False, "method": "topk", "schedule_offset": 1000, "num_heads": None},
    "channel_pruning": {"enabled": False, "method": "l1", "schedule_offset": 1000},
}
_METHODS = {
    "sparse_pruning": ("l1", "topk", "snip_momentum"),
    "row_pruning": ("l1", "topk"),
    "head_pruning": ("l1", "topk"),
    "channel_pruning": ("l1", "topk"),
}
# technique -> (group params it needs, group params with defaults)
_GROUP_PARAMS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "weight_quantization": (("start_bits", "target_bits"), {"quantization_period": 1}),
    "activation_quantization": (("bits",), {}),
    "sparse_pruning": (("dense_ratio",), {}),
    "row_pruning": (("dense_ratio",), {}),
    "head_pruning": (("dense_ratio",), {}),
    "channel_pruning": (("dense_ratio",), {}),
}
_LAYER_REDUCTION_KEYS = ("enabled", "keep_number_layer", "module_name_prefix", "teacher_layer", "other_module_name")
MAX_WEIGHT_BITS = 16
"""The widest weight quantization accepted (DeepSpeed's MoQ examples start at 16 bits)."""


@dataclass(frozen=True, kw_only=True)
class CompressionGroup:
    """One ``different_groups`` entry: a technique's settings for the modules it names."""

    name: str
    """The group's key in ``different_groups`` (named in errors)."""
    params: Mapping[str, Any]
    """The technique's per-group settings, defaults filled (bits, period, dense_ratio)."""
    modules: tuple[str, ...]
    """Module-name patterns, matched with ``re.search`` against ``named_modules()`` names
    (DeepSpeed's rule); DeepSpeed's default ``"*"`` means every compressible module."""
    related_modules: tuple[tuple[str, ...], ...] | None = None
    """Row, head and channel pruning: for each pattern of ``modules``, the patterns of the
    modules whose input columns (rows, for head pruning's Q/K/V; for channel pruning the
    BatchNorm2d's features and the next Conv2d's input channels) ``redundancy_clean``
    removes with the pruned rows, heads or channels. None: pruned rows are only zeroed."""


@dataclass(frozen=True, kw_only=True)
class TechniqueConfig:
    """One technique: its shared parameters and its groups."""

    name: str
    """The technique's key (``weight_quantization``, ``row_pruning``, ...)."""
    shared: Mapping[str, Any]
    """``shared_parameters`` with DeepSpeed's defaults filled in."""
    groups: tuple[CompressionGroup, ...] = ()
    """``different_groups``, in the order given."""

    @property
    def enabled(self) -> bool:
        return self.shared["enabled"]


@dataclass(frozen=True, kw_only=True)
class LayerReductionConfig:
    """``layer_reduction``: ``init_compression`` initializes the student from the teacher."""

    enabled: bool = False
    """Initialize a shallower student from chosen teacher layers."""
    keep_number_layer: int | None = None
    """How many layers the student keeps."""
    module_name_prefix: str = ""
    """The dotted name of the layer list (``transformer.h``)."""
    teacher_layer: tuple[int, ...] = ()
    """The teacher layers copied into the student's layers 0, 1, ..."""
    other_module_name: tuple[str, ...] = ()
    """Other modules copied from the teacher (embeddings, final norm, head)."""


def _technique_default(name: str) -> TechniqueConfig:
    shared = {k: v for k, v in _SHARED[name].items() if v is not None}
    return TechniqueConfig(name=name, shared=shared)


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """The ``compression_training`` section: one entry per technique."""

    weight_quantization: TechniqueConfig = field(default_factory=lambda: _technique_default("weight_quantization"))
    """Quantization-aware training of weights (fake quantization, straight-through gradients)."""
    activation_quantization: TechniqueConfig = field(
        default_factory=lambda: _technique_default("activation_quantization")
    )
    """Fake quantization of the layers' inputs."""
    sparse_pruning: TechniqueConfig = field(default_factory=lambda: _technique_default("sparse_pruning"))
    """Unstructured pruning: a mask over weight elements."""
    row_pruning: TechniqueConfig = field(default_factory=lambda: _technique_default("row_pruning"))
    """Structured pruning of output rows (and the next layer's input columns)."""
    head_pruning: TechniqueConfig = field(default_factory=lambda: _technique_default("head_pruning"))
    """Attention-head pruning on the output projection (and Q/K/V's rows)."""
    channel_pruning: TechniqueConfig = field(default_factory=lambda: _technique_default("channel_pruning"))
    """Structured pruning of Conv2d output channels (and the related layers' channels)."""
    layer_reduction: LayerReductionConfig = field(default_factory=LayerReductionConfig)
    """Student initialization from chosen teacher layers."""

    def techniques(self) -> tuple[TechniqueConfig, ...]:
        """Every layer technique, in :data:`TECHNIQUES` order."""
        return tuple(getattr(self, name) for name in TECHNIQUES)

    @property
    def enabled(self) -> bool:
        """Whether any layer technique is on."""
        return any(t.enabled for t in self.techniques())


def _patterns(path: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path} must be a module-name pattern or a non-empty list of them, got {value!r}")
    return tuple(".*" if v == "*" else v for v in value)


def _bits(path: str, value: Any, lowest: int) -> int:
    return as_int(path, value, minimum=lowest, maximum=MAX_WEIGHT_BITS)


def _group_params(technique: str, path: str, params: Any, shared: Mapping) -> dict:
    needed, defaults = _GROUP_PARAMS[technique]
    check_keys(path, params, set(needed) | set(defaults))
    for key in needed:
        if key not in params:
            raise ConfigError(f"{path} needs '{key}' (every {technique} group has one)")
    out = {**defaults, **params}
    if technique == "weight_quantization":
        start = _bits(f"{path}.start_bits", out["start_bits"], 1)
        target = _bits(f"{path}.target_bits", out["target_bits"], 1)
        if target > start:
            raise ConfigError(f"{path}.target_bits ({target}) must not exceed start_bits ({start})")
        as_int(f"{path}.quantization_period", out["quantization_period"], minimum=1)
        if target <= 2 and (shared["quantization_type"], shared["rounding"]) != ("symmetric", "nearest"):
            raise ConfigError(
                f"{path}.target_bits={target} (ternary/binary weights) needs quantization_type "
                "'symmetric' and rounding 'nearest' in weight_quantization.shared_parameters"
            )
    elif technique == "activation_quantization":
        if out["bits"] not in (4, 8) or isinstance(out["bits"], bool):
            raise ConfigError(f"{path}.bits must be 4 or 8 (activation quantization), got {out['bits']!r}")
    else:
        ratio = as_number(f"{path}.dense_ratio", out["dense_ratio"])
        if not 0 < ratio <= 1:
            raise ConfigError(f"{path}.dense_ratio must be in (0, 1] (the fraction kept), got {ratio!r}")
    return out


def _group(technique: str, path: str, name: str, body: Any, shared: Mapping) -> CompressionGroup:
    check_keys(path, body, {"params", "modules", "related_modules"})
    if "params" not in body:
        raise ConfigError(f"{path} needs 'params'")
    modules = _patterns(f"{path}.modules", body.get("modules", "*"))
    related = body.get("related_modules")
    if related is not None:
        if not isinstance(related, (list, tuple)) or len(related) != len(modules):
            raise ConfigError(
                f"{path}.related_modules must be a list with one list of patterns per entry of "
                f"modules ({len(modules)}), got {related!r}"
            )
        related = tuple(_patterns(f"{path}.related_modules[{i}]", r) for i, r in enumerate(related))
    params = _group_params(technique, f"{path}.params", body["params"], shared)
    return CompressionGroup(name=name, params=params, modules=modules, related_modules=related)


def _shared(technique: str, path: str, section: Any) -> dict:
    spec = _SHARED[technique]
    check_keys(path, section, spec)
    out = {k: v for k, v in spec.items() if v is not None}
    out.update(section)
    for key in ("enabled", "quantizer_kernel", "quantize_verbose", "quantize_weight_in_forward"):
        if key in out:
            as_bool(f"{path}.{key}", out[key])
    as_int(f"{path}.schedule_offset", out["schedule_offset"], minimum=0)
    if "quantization_type" in out:
        out["quantization_type"] = as_choice(
            f"{path}.quantization_type", out["quantization_type"], ("symmetric", "asymmetric")
        )
    if "rounding" in out:
        out["rounding"] = as_choice(f"{path}.rounding", out["rounding"], ("nearest", "stochastic"))
    if "range_calibration" in out:
        out["range_calibration"] = as_choice(
            f"{path}.range_calibration", out["range_calibration"], ("dynamic", "static")
        )
    if technique in _METHODS:
        out["method"] = as_choice(f"{path}.method", out["method"], _METHODS[technique])
    if technique == "weight_quantization":
        as_int(f"{path}.quantize_groups", out["quantize_groups"], minimum=1)
        if "quantize_group_size" in out:
            as_int(f"{path}.quantize_group_size", out["quantize_group_size"], minimum=1)
            if "quantize_groups" in section:
                raise ConfigError(
                    f"{path}: give quantize_groups (groups per weight) or quantize_group_size (input columns "
                    "per group), not both"
                )
        check_keys(f"{path}.fp16_mixed_quantize", out["fp16_mixed_quantize"], {"enabled", "quantize_change_ratio"})
    if technique == "sparse_pruning":
        out.setdefault("schedule_offset_end", out["schedule_offset"])
    if technique == "head_pruning" and out["enabled"]:
        if "num_heads" not in out:
            raise ConfigError(f"{path} needs 'num_heads' (head_pruning is enabled)")
        as_int(f"{path}.num_heads", out["num_heads"], minimum=1)
    return out


@dataclass(frozen=True, kw_only=True)
class BlockPattern:
    """snip_momentum's ``block_pattern`` as Intel Neural Compressor read it, on each weight's
    2-D view (rows: output channels; columns: the input dimension, for a convolution its
    kernel positions and input channels, input channels fastest)."""

    kind: Literal["NxM", "N:M"]
    """``NxM``: blocks of ``n`` rows by ``m`` columns pruned whole; ``N:M``: ``n`` of every
    ``m`` consecutive weights of a row pruned (INC's rule: N counts the pruned ones)."""
    n: int
    m: int

    def __str__(self) -> str:
        return f"{self.n}x{self.m}" if self.kind == "NxM" else f"{self.n}:{self.m}"

    @property
    def max_sparsity(self) -> float:
        """The largest fraction of weights the pattern can prune."""
        return 1.0 if self.kind == "NxM" else self.n / self.m


def parse_block_pattern(path: str, pattern: Any) -> BlockPattern:
    """``"NxM"``: blocks of N output rows by M input columns (Intel Neural Compressor's
    rule: the first number runs along the weight's output dimension); ``"N:M"``: N of every
    M consecutive input weights pruned (1 <= N < M).

    Raises:
        ConfigError: any other pattern (INC's ``"channelxM"`` / ``"Nxchannel"`` are refused by name).
    """
    text = pattern if isinstance(pattern, str) else ""
    rows, cross, cols = text.partition("x")
    if cross and rows.isdigit() and cols.isdigit() and int(rows) >= 1 and int(cols) >= 1:
        return BlockPattern(kind="NxM", n=int(rows), m=int(cols))
    pruned, colon, group = text.partition(":")
    if colon and pruned.isdigit() and group.isdigit():
        if 1 <= int(pruned) < int(group):
            return BlockPattern(kind="N:M", n=int(pruned), m=int(group))
        raise ConfigError(
            f"{path} {pattern!r}: an 'N:M' pattern prunes N of every M consecutive weights and needs "
            "1 <= N < M, such as '2:4'"
        )
    if "channel" in text:
        raise ConfigError(
            f"{path} {pattern!r}: the channel patterns of Intel Neural Compressor are not available in this "
            "version of shardwise; use an 'NxM' block pattern such as '4x1' or an 'N:M' pattern such as '2:4'"
        )
    raise ConfigError(
        f"{path} must be an 'NxM' block pattern (N, M >= 1) such as '4x1' or an 'N:M' pattern (1 <= N < M) "
        f"such as '2:4', got {pattern!r}"
    )


def _snip_momentum(path: str, shared: dict) -> None:
    """DeepSpeed's checks of the snip_momentum keys (they live in shared_parameters)."""
    ratio = as_number(f"{path}.dense_ratio", shared["dense_ratio"])
    if not 0 < ratio < 1:
        raise ConfigError(f"{path}.dense_ratio must be in (0, 1) for snip_momentum (the fraction kept), got {ratio!r}")
    pattern = parse_block_pattern(f"{path}.block_pattern", shared["block_pattern"])
    if 1 - ratio > pattern.max_sparsity + 1e-9:
        raise ConfigError(
            f"{path}.dense_ratio {ratio!r} prunes {1 - ratio:.0%} of the weights, but block_pattern "
            f"'{pattern}' prunes at most {pattern.n} of every {pattern.m}: set dense_ratio >= "
            f"{1 - pattern.max_sparsity:g} or pick a pattern that prunes more"
        )
    if shared["schedule_offset"] < 1:
        raise ConfigError(
            f"{path}.schedule_offset must be >= 1 for snip_momentum: its scores come from the gradients "
            "of the steps before the first pruning step"
        )
    as_int(f"{path}.schedule_offset_stride", shared["schedule_offset_stride"], minimum=1)
    end = as_int(f"{path}.schedule_offset_end", shared["schedule_offset_end"], minimum=0)
    if end < shared["schedule_offset"]:
        raise ConfigError(f"{path}.schedule_offset_end ({end}) must not be below schedule_offset")
    excluded = shared["excluded_modules"]
    if not isinstance(excluded, (list, tuple)) or not all(isinstance(e, str) for e in excluded):
        raise ConfigError(f"{path}.excluded_modules must be a list of module-name patterns, got {excluded!r}")


def _refuse_unbuilt(path: str, technique: str, shared: Mapping) -> None:
    """Refuse, by name, the parts of an enabled technique this version does not build."""
    if technique == "weight_quantization" and shared["fp16_mixed_quantize"].get("enabled", False):
        raise ConfigError(
            f"{path}.fp16_mixed_quantize (blending fp16 and quantized weights in DeepSpeed's MoQ "
            "optimizer step) is not available in this version of shardwise; set its enabled to false"
        )


def _technique(name: str, section: Any) -> TechniqueConfig:
    path = f"compression_training.{name}"
    check_keys(path, section, {"shared_parameters", "different_groups"})
    shared = _shared(name, f"{path}.shared_parameters", section.get("shared_parameters", {}))
    groups_raw = section.get("different_groups", {})
    snip = name == "sparse_pruning" and shared["method"] == "snip_momentum"
    if shared["enabled"] and snip:
        _snip_momentum(f"{path}.shared_parameters", shared)
        if groups_raw:
            raise ConfigError(
                f"{path}.different_groups: snip_momentum prunes every nn.Linear and nn.Conv2d layer but those of "
                "shared_parameters.excluded_modules, to shared_parameters.dense_ratio (as DeepSpeed, whose "
                "groups fail with this method); remove different_groups"
            )
    elif shared["enabled"]:
        _refuse_unbuilt(f"{path}.shared_parameters", name, shared)
        if not groups_raw:
            raise ConfigError(f"{path} is enabled: it needs 'different_groups' naming the modules to compress")
    check_keys(f"{path}.different_groups", groups_raw, set(groups_raw))
    groups = tuple(_group(name, f"{path}.different_groups.{g}", g, body, shared) for g, body in groups_raw.items())
    return TechniqueConfig(name=name, shared=shared, groups=groups)


def _layer_reduction(section: Any) -> LayerReductionConfig:
    path = "compression_training.layer_reduction"
    check_keys(path, section, _LAYER_REDUCTION_KEYS)
    if not as_bool(f"{path}.enabled", section.get("enabled", False)):
        return LayerReductionConfig()
    for key in ("module_name_prefix", "teacher_layer"):
        if key not in section:
            raise ConfigError(f"{path} needs '{key}' (layer_reduction is enabled)")
    prefix = section["module_name_prefix"]
    if not isinstance(prefix, str) or not prefix:
        raise ConfigError(f"{path}.module_name_prefix must be a module name (transformer.h), got {prefix!r}")
    layers = section["teacher_layer"]
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ConfigError(f"{path}.teacher_layer must be a non-empty list of layer indices, got {layers!r}")
    layers = tuple(as_int(f"{path}.teacher_layer[{i}]", v, minimum=0) for i, v in enumerate(layers))
    keep = section.get("keep_number_layer")
    if keep is not None and as_int(f"{path}.keep_number_layer", keep, minimum=1) != len(layers):
        raise ConfigError(f"{path}.keep_number_layer ({keep}) must equal the length of teacher_layer ({len(layers)})")
    others = section.get("other_module_name", [])
    if not isinstance(others, (list, tuple)) or not all(isinstance(o, str) for o in others):
        raise ConfigError(f"{path}.other_module_name must be a list of module names, got {others!r}")
    return LayerReductionConfig(
        enabled=True,
        keep_number_layer=keep,
        module_name_prefix=prefix,
        teacher_layer=layers,
        other_module_name=tuple(others),
    )


def compression_config(section: Any) -> CompressionConfig:
    """Parse ``compression_training`` (None: every technique off).

    Raises:
        ConfigError: an unknown key (with a did-you-mean), a missing group parameter, bits
            out of range, a dense ratio outside (0, 1], an unknown method, or an enabled
            technique this version does not build (named).
    """
    if section is None:
        return CompressionConfig()
    check_keys("compression_training", section, set(TECHNIQUES) | {"layer_reduction"})
    fields = {name: _technique(name, section[name]) for name in TECHNIQUES if name in section}
    if "layer_reduction" in section:
        fields["layer_reduction"] = _layer_reduction(section["layer_reduction"])
    return dataclasses.replace(CompressionConfig(), **fields)
