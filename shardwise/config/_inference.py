"""The inference config: DeepSpeed's ``init_inference`` keys, from a dict, a JSON file or
keyword arguments (keyword arguments win, as in DeepSpeed). Pure Python apart from the
dtype names; what a key asks for that this version cannot do is refused by name."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.config._errors import ConfigError, as_bool, as_int, check_keys

logger = logging.getLogger("shardwise")

_ALIASES = {
    "kernel_inject": "replace_with_kernel_inject",
    "tp": "tensor_parallel",
    "tm": "triangular_masking",
    "ckpt_config": "checkpoint_config",
    "injection_dict": "injection_policy",
    "args": "config",
    "max_tokens": "max_out_tokens",
    "min_tokens": "min_out_tokens",
    "expert_group": "ep_group",
    "expert_mp_group": "ep_mp_group",
}
_INERT = {
    "triangular_masking",
    "training_mp_size",
    "replace_method",
    "config",
    "transposed_mode",
    "triton_autotune",
    "keep_module_on_host",
    "set_empty_params",
    "checkpoint_config",
}
"""Keys DeepSpeed reads that change nothing here (layout and kernel details of its own
kernels); accepted so DeepSpeed configs load. Those among them that would ask for
something this version does not do (a non-causal mask, model-parallel training
checkpoints, a checkpoint named in ``checkpoint_config``) are refused by
``_refuse_unsupported``."""
_MOE = {"moe", "ep_size", "ep_group", "ep_mp_group", "moe_experts", "moe_type"}
_KEYS = (
    {
        "replace_with_kernel_inject",
        "dtype",
        "tensor_parallel",
        "enable_cuda_graph",
        "use_triton",
        "zero",
        "quant",
        "checkpoint",
        "base_dir",
        "save_mp_checkpoint_path",
        "return_tuple",
        "injection_policy",
        "injection_policy_tuple",
        "max_out_tokens",
        "min_out_tokens",
        "mp_size",
        "mpu",
    }
    | _INERT
    | _MOE
    | set(_ALIASES)
)

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    """What :func:`shardwise.init_inference` does to a model (DeepSpeed's defaults)."""

    dtype: torch.dtype = torch.float16
    """The dtype the model runs in. ``torch.int8`` keeps activations in float16 (float32 on
    CPU, whose float16 matmuls are slow) and stores the linear layers' weights as int8 with
    one scale per output channel."""
    tp_size: int = 1
    """Tensor-parallel degree (``tensor_parallel.tp_size``, legacy ``mp_size``)."""
    tp_group: Any = None
    """The tensor-parallel process group (``tensor_parallel.tp_group`` or an ``mpu``);
    None: the first ``tp_size`` ranks of the world form it, and so on."""
    replace_with_kernel_inject: bool = False
    """The fast path: static KV cache, fused projections, SDPA (see [Note: the fast decoder])."""
    enable_cuda_graph: bool | None = None
    """Replay the fast path's decode step as a CUDA graph ([Note: decode graphs]). None
    (the default): on a CUDA device at tp 1 with the fast path; True: required (refused
    where it cannot be: no CUDA device, no fast path, tp > 1); False: never."""
    injection_policy: dict | None = None
    """Module class (or its name) -> names of the linear layers whose outputs are reduced
    (row-parallel); the other linear layers of those modules are split by columns."""
    checkpoint: str | dict | None = None
    """A safetensors / ``.bin`` file or directory, a shardwise training checkpoint, or
    DeepSpeed's JSON ``{"type", "checkpoints", "version"}`` (dict or path)."""
    base_dir: str = ""
    """Directory the checkpoint JSON's file names are relative to."""
    max_out_tokens: int = 1024
    """Most tokens (prompt plus generated) one sequence may reach."""
    min_out_tokens: int = 1
    """Accepted for DeepSpeed's configs (its kernels' workspace hint)."""
    return_tuple: bool = True
    """Accepted for DeepSpeed's configs: the engine returns what the model returns."""
    quant: dict = field(default_factory=dict)
    """DeepSpeed's ``quant`` section: ``{"enabled": true, "weight": {"num_bits": 8}}`` is
    the same as ``dtype=torch.int8`` for the weights."""
    ep_size: int = 1
    """Ranks the experts of the model's MoE blocks are split over (``moe.ep_size``, or the
    top-level ``ep_size``); see [Note: experts at inference] in ``inference/engine.py``."""

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
            raise ConfigError(f"dtype must be float32, float16, bfloat16 or int8, got {self.dtype!r}")
        as_int("tensor_parallel.tp_size", self.tp_size, minimum=1)
        as_int("moe.ep_size", self.ep_size, minimum=1)
        as_int("max_out_tokens", self.max_out_tokens, minimum=1)
        as_bool("replace_with_kernel_inject", self.replace_with_kernel_inject)
        if self.enable_cuda_graph is not None:
            as_bool("enable_cuda_graph", self.enable_cuda_graph)

    @property
    def int8_weights(self) -> bool:
        """Whether linear weights are stored as int8."""
        weight = self.quant.get("weight", {}) if isinstance(self.quant.get("weight"), dict) else {}
        return self.dtype == torch.int8 or (bool(self.quant.get("enabled", False)) and weight.get("enabled", True))


def inference_config(
    config: str | os.PathLike | dict | InferenceConfig | None = None, **kwargs: Any
) -> InferenceConfig:
    """The :class:`InferenceConfig` from a dict or JSON path merged with keyword arguments
    (which take precedence), DeepSpeed's aliases resolved, unknown keys refused with a
    close match."""
    if isinstance(config, InferenceConfig):
        if kwargs:
            raise ConfigError("pass the InferenceConfig or keyword arguments, not both")
        return config
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"inference config file {os.fspath(config)!r} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"inference config file {os.fspath(config)!r} is not valid JSON: {exc}") from None
    merged = dict(config or {})
    merged.update(kwargs)
    check_keys("", merged, _KEYS)
    values = {}
    for key, value in merged.items():
        name = _ALIASES.get(key, key)
        if name in values and values[name] != value:
            raise ConfigError(f"both '{name}' and its alias '{key}' are set, to different values; keep one")
        values[name] = value
    return _build(values)


def _build(values: dict) -> InferenceConfig:
    _refuse_unsupported(values)
    tp_section = values.get("tensor_parallel") or {}
    if not isinstance(tp_section, dict):  # DeepSpeedTPConfig-like object
        tp_section = {
            k: getattr(tp_section, k) for k in ("enabled", "tp_size", "mpu", "tp_group") if hasattr(tp_section, k)
        }
    check_keys("tensor_parallel", tp_section, {"enabled", "tp_size", "tp_grain_size", "mpu", "tp_group"})
    tp_size = tp_section.get("tp_size", 1) if tp_section.get("enabled", True) else 1
    mp_size = values.get("mp_size", 1)
    if mp_size != 1:
        if tp_size not in (1, mp_size):
            raise ConfigError(
                f"mp_size ({mp_size}) and tensor_parallel.tp_size ({tp_size}) differ; set "
                "tensor_parallel.tp_size only (mp_size is its deprecated name)"
            )
        logger.warning(
            "init_inference: mp_size is deprecated (DeepSpeed's name too); use tensor_parallel={'tp_size': %d}", mp_size
        )
        tp_size = mp_size
    group = tp_section.get("tp_group") or tp_section.get("mpu") or values.get("mpu")
    policy = values.get("injection_policy")
    if values.get("injection_policy_tuple") is not None:
        policy = {**(policy or {}), values["injection_policy_tuple"][0]: values["injection_policy_tuple"][1:]}
    if policy is not None and not isinstance(policy, dict):
        raise ConfigError(
            f"injection_policy must map a module class to the names of its row-parallel linear "
            f"layers, e.g. {{LlamaDecoderLayer: ('self_attn.o_proj', 'mlp.down_proj')}}; "
            f"got {policy!r}"
        )
    quant = values.get("quant") or {}
    if not isinstance(quant, dict):
        raise ConfigError(
            f'quant must be an object like {{"enabled": true, "weight": {{"num_bits": 8}}}}, got {quant!r}'
        )
    bits = (quant.get("weight") or {}).get("num_bits", 8) if isinstance(quant.get("weight"), dict) else 8
    if quant.get("enabled", False) and bits != 8:
        raise ConfigError(f"quant.weight.num_bits={bits}: only 8-bit weights are available; set it to 8")
    if quant.get("enabled", False) and (quant.get("activation") or {}).get("enabled", False):
        raise ConfigError(
            "quant.activation.enabled: only weights are quantised (activations stay in floating "
            "point); remove quant.activation"
        )
    options = dict(
        dtype=_dtype(values.get("dtype", torch.float16)),
        tp_size=tp_size,
        ep_size=_ep_size(values),
        tp_group=group,
        injection_policy=policy,
        quant=quant,
    )
    for key in (
        "replace_with_kernel_inject",
        "enable_cuda_graph",
        "checkpoint",
        "base_dir",
        "max_out_tokens",
        "min_out_tokens",
        "return_tuple",
    ):
        if key in values:
            options[key] = values[key]
    return InferenceConfig(**options)


def _refuse_unsupported(values: dict) -> None:
    if values.get("triangular_masking", True) is False:
        raise ConfigError(
            "triangular_masking=false: the fast path and the models' own forward use causal "
            "(triangular) masks only; remove triangular_masking"
        )
    if values.get("training_mp_size", 1) != 1:
        raise ConfigError(
            f"training_mp_size={values['training_mp_size']}: checkpoints split by model parallelism "
            "in training are not read; give the full checkpoint files (each rank reads its slices)"
        )
    if any((values.get("checkpoint_config") or {}).values()):
        raise ConfigError(
            "checkpoint_config: name the checkpoint with checkpoint= (and base_dir=) instead; "
            f"got {values['checkpoint_config']!r}"
        )
    if values.get("use_triton"):
        raise ConfigError(
            "use_triton: shardwise's inference runs on PyTorch (SDPA, torch.compile) without "
            "Triton kernels of its own; remove use_triton"
        )
    if values.get("zero"):
        raise ConfigError(
            "zero: ZeRO-Inference (parameters partitioned across ranks for inference) is not "
            "available; use tensor_parallel.tp_size to split the model"
        )
    moe = values.get("moe")
    if isinstance(moe, dict):
        check_keys("moe", moe, {"enabled", "ep_size", "moe_experts", "type", "ep_mp_group", "ep_group"})
        if moe.get("type", "standard") != "standard":
            raise ConfigError(f"moe.type={moe['type']!r}: only 'standard' MoE layers are served (no residual MoE)")
    groups = [k for k in ("ep_group", "ep_mp_group") if values.get(k) is not None]
    groups += [f"moe.{k}" for k in ("ep_group", "ep_mp_group") if isinstance(moe, dict) and moe.get(k) is not None]
    if groups:
        raise ConfigError(
            f"{groups}: shardwise builds the expert groups itself from ep_size (consecutive ranks of the "
            "world); pass moe={'ep_size': N} instead of process groups"
        )
    if values.get("save_mp_checkpoint_path"):
        raise ConfigError(
            "save_mp_checkpoint_path: saving the tensor-parallel shards is not available; load "
            "from the original checkpoint on every start (each rank reads only its slices)"
        )


def _ep_size(values: dict) -> int:
    """``moe.ep_size`` (DeepSpeed's MoE config) or the legacy top-level ``ep_size``; 1 when
    ``moe`` is off."""
    moe = values.get("moe")
    if moe is False or (isinstance(moe, dict) and not moe.get("enabled", True)):
        return 1
    size = moe.get("ep_size", values.get("ep_size", 1)) if isinstance(moe, dict) else values.get("ep_size", 1)
    return as_int("moe.ep_size", size, minimum=1)


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.lower().removeprefix("torch.")]
    raise ConfigError(f"dtype must be a torch dtype or one of {sorted(_DTYPES)}, got {value!r}")
