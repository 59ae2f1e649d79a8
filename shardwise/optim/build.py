"""Build a torch optimizer from the config's ``optimizer`` section (DeepSpeed's names)."""

from __future__ import annotations

import difflib
import importlib
import logging
from collections.abc import Mapping
from typing import Any

import torch

from shardwise.optim.lamb import Lamb
from shardwise.optim.lion import Lion

logger = logging.getLogger("shardwise")

# Keys torch's own optimizers take beyond DeepSpeed's, passed through unchanged.
_TORCH_KNOBS = ("foreach", "fused", "maximize", "differentiable")
_ADAM_KEYS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "adam_w_mode",
    "torch_adam",
    "bias_correction",
    "set_grad_none",
    "capturable",
) + _TORCH_KNOBS
_ONEBIT_KEYS = (
    "lr",
    "bias_correction",
    "betas",
    "eps",
    "eps_inside_sqrt",
    "weight_decay",
    "amsgrad",
    "cuda_aware",
    "comm_backend_name",
)
_ALLOWED: dict[str, tuple[str, ...]] = {
    "adam": _ADAM_KEYS,
    "adamw": _ADAM_KEYS,
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov") + _TORCH_KNOBS,
    "adagrad": ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps") + _TORCH_KNOBS,
    "lamb": (
        "lr",
        "bias_correction",
        "betas",
        "eps",
        "eps_inside_sqrt",
        "weight_decay",
        "max_coeff",
        "min_coeff",
        "amsgrad",
    ),
    "lion": ("lr", "betas", "weight_decay", "set_grad_none"),
    "onebitadam": _ONEBIT_KEYS + ("freeze_step",),
    "zerooneadam": _ONEBIT_KEYS + ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"),
    "onebitlamb": _ONEBIT_KEYS
    + ("freeze_step", "max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min", "factor_threshold"),
}
_ONEBIT = {
    "onebitadam": ("shardwise.optim.onebit.adam", "OneBitAdam"),
    "zerooneadam": ("shardwise.optim.onebit.zoadam", "ZeroOneAdam"),
    "onebitlamb": ("shardwise.optim.onebit.lamb", "OneBitLamb"),
}
# Optimizers whose torch implementation has fused CUDA and CPU kernels we select by default
# (on CPU, fused AdamW steps about 5x faster than the multi-tensor path: bench/README.md).
_FUSED = ("adam", "adamw", "sgd", "adagrad")


def _tensors(params: list) -> list[torch.Tensor]:
    """Every tensor in ``params`` (tensors, (name, tensor) pairs or param-group dicts)."""
    out: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, Mapping):
            out.extend(_tensors(list(item["params"])))
        elif isinstance(item, tuple):
            out.append(item[1])
        else:
            out.append(item)
    return out


def _fast_path(name: str, params: list, kwargs: dict) -> dict:
    """torch's fused kernels when every tensor is on CUDA or every tensor is on the CPU,
    multi-tensor (foreach) otherwise.

    Left alone when the user chose ``fused``/``foreach`` or asked for ``differentiable``.
    """
    if any(k in kwargs for k in ("fused", "foreach")) or kwargs.get("differentiable"):
        return {}
    tensors = _tensors(params)
    devices = {t.device.type for t in tensors}
    if (
        name in _FUSED
        and len(devices) == 1
        and devices <= {"cuda", "cpu"}
        and all(t.is_floating_point() and not t.is_sparse for t in tensors)
    ):
        return {"fused": True}
    return {"foreach": True}


def _check_keys(name: str, given: Mapping[str, Any]) -> None:
    if name not in _ALLOWED:
        match = difflib.get_close_matches(str(name), list(_ALLOWED), n=1)
        hint = f"; did you mean {match[0]!r}?" if match else ""
        raise ValueError(f"unknown optimizer {name!r}{hint} (known: {', '.join(_ALLOWED)})")
    if "max_grad_norm" in given:
        # DeepSpeed refuses this key too: clipping is an engine feature.
        raise ValueError(
            "optimizer.params.max_grad_norm is not supported; use the top-level 'gradient_clipping' config key"
        )
    allowed = _ALLOWED[name]
    for key in given:
        if key not in allowed:
            match = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean {match[0]!r}?" if match else ""
            raise ValueError(
                f"optimizer {name!r} has no parameter {key!r}{hint} (allowed: {', '.join(sorted(allowed))})"
            )


def _adam(name: str, params: list, kwargs: dict) -> torch.optim.Optimizer:
    """DeepSpeed's Adam/AdamW choice, mapped onto torch.optim.Adam or AdamW."""
    torch_adam = bool(kwargs.pop("torch_adam", False))
    adam_w_mode = bool(kwargs.pop("adam_w_mode", True))
    kwargs.pop("set_grad_none", None)  # torch's zero_grad() already sets grads to None
    if not kwargs.pop("bias_correction", True):
        raise ValueError(
            f"optimizer {name!r}: bias_correction=false is not supported (torch's Adam always corrects the moments)"
        )
    # DeepSpeed: type AdamW is always decoupled; type Adam is decoupled unless
    # adam_w_mode is false. torch_adam only picks the implementation.
    decoupled = name == "adamw" or adam_w_mode
    if not torch_adam:
        # DeepSpeed's FusedAdam defaults weight_decay to 0; torch's AdamW to 0.01.
        kwargs.setdefault("weight_decay", 0.0)
    kwargs.update(_fast_path(name, params, kwargs))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(params, **kwargs)


def build_optimizer(config, params) -> torch.optim.Optimizer:
    """The optimizer ``config`` names, over ``params``, with DeepSpeed's parameter names.

    Values equal to ``"auto"`` count as absent, so the optimizer's own default applies.
    ``adam`` and ``adamw`` follow DeepSpeed's engine: weight decay is decoupled
    (torch.optim.AdamW) unless the type is ``adam`` with ``adam_w_mode: false``
    (torch.optim.Adam, L2 decay); ``torch_adam`` only changes the default weight decay to
    torch's. ``lamb`` builds :class:`~shardwise.optim.Lamb`, ``lion``
    :class:`~shardwise.optim.Lion`. When every tensor is on CUDA,
    or every tensor is on the CPU (as with offload_optimizer), Adam/AdamW/SGD/Adagrad use
    torch's fused kernels, otherwise the multi-tensor (foreach) ones, unless ``fused`` or
    ``foreach`` is given. ``onebitadam``, ``zerooneadam`` and ``onebitlamb`` build the 1-bit
    optimizers of ``shardwise.optim.onebit``, which the engine binds to its data-parallel
    group. Nothing is allocated until the first step.

    Args:
        config: has ``type`` (adam, adamw, sgd, adagrad, lamb, lion, onebitadam, zerooneadam,
            onebitlamb) and ``params`` (a mapping
            of the optimizer's parameters, DeepSpeed names).
        params: what the optimizer updates: tensors, (name, tensor) pairs or param-group
            dicts; per-group values override ``config.params``.

    Raises:
        ValueError: an unknown optimizer, a parameter it does not take (naming the closest
            match and the allowed ones), ``max_grad_norm``, or ``bias_correction: false``
            for Adam.
    """
    name = config.type
    given = {k: v for k, v in dict(config.params or {}).items() if not (isinstance(v, str) and v == "auto")}
    _check_keys(name, given)
    params = list(params)
    kwargs = dict(given)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if name == "lamb":
        return Lamb(params, **kwargs)
    if name in _ONEBIT:
        module, cls = _ONEBIT[name]
        return getattr(importlib.import_module(module), cls)(params, **kwargs)
    if name == "lion":
        kwargs.pop("set_grad_none", None)
        kwargs.setdefault("betas", (0.9, 0.999))  # DeepSpeed's FusedLion default
        return Lion(params, **kwargs)
    if name in ("adam", "adamw"):
        return _adam(name, params, kwargs)
    kwargs.update(_fast_path(name, params, kwargs))
    cls = torch.optim.SGD if name == "sgd" else torch.optim.Adagrad
    return cls(params, **kwargs)
