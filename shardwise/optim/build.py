"""Build a torch optimizer from the config's ``optimizer`` section (DeepSpeed's names)."""

from __future__ import annotations

import difflib
from typing import Any, Mapping

import torch

from shardwise.optim.lamb import Lamb

_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "torch_adam",
              "bias_correction", "fused", "foreach", "capturable", "maximize", "differentiable"}
_ALLOWED = {
    "adam": _ADAM_KEYS,
    "adamw": _ADAM_KEYS,
    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach"},
    "adagrad": {"lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "foreach",
                "maximize"},
    "lamb": {"lr", "bias_correction", "betas", "eps", "weight_decay", "max_grad_norm", "max_coeff",
             "min_coeff", "amsgrad"},
}
_DEFAULT_LR = {"adam": 1e-3, "adamw": 1e-3, "sgd": 1e-3, "adagrad": 1e-2, "lamb": 1e-3}


def _all_params(params) -> list[torch.Tensor]:
    out = []
    for item in params:
        out.extend(item["params"] if isinstance(item, dict) else [item])
    return out


def _fast_path(params) -> dict:
    """torch's fused kernels on CUDA, multi-tensor (foreach) kernels elsewhere."""
    tensors = _all_params(params)
    if tensors and all(t.is_cuda for t in tensors):
        return {"fused": True}
    return {"foreach": True}


def build_optimizer(config, params) -> torch.optim.Optimizer:
    """The optimizer ``config`` names, over ``params`` (tensors or param-group dicts).

    ``adam`` follows DeepSpeed: weight decay is decoupled (AdamW) unless
    ``adam_w_mode: false`` or ``torch_adam: true`` ask for torch.optim.Adam's L2 decay.

    Args:
        config: has ``type`` (adam, adamw, sgd, adagrad, lamb) and ``params`` (a mapping).
        params: what the optimizer updates.

    Raises:
        ValueError: a parameter name the optimizer does not take (with the closest match).
    """
    name = config.type
    given: Mapping[str, Any] = {k: v for k, v in dict(config.params).items() if v != "auto"}
    allowed = _ALLOWED[name]
    for key in given:
        if key not in allowed:
            match = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean '{match[0]}'?" if match else f"; allowed: {', '.join(sorted(allowed))}"
            raise ValueError(f"optimizer {name!r} has no parameter {key!r}{hint}")
    params = list(params)
    kwargs = dict(given)
    kwargs.setdefault("lr", _DEFAULT_LR[name])
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if name == "lamb":
        return Lamb(params, **kwargs)
    if name in ("adam", "adamw"):
        decoupled = name == "adamw" or (kwargs.get("adam_w_mode", True) and not kwargs.get("torch_adam", False))
        for key in ("adam_w_mode", "torch_adam", "bias_correction"):
            kwargs.pop(key, None)
        if "fused" not in kwargs and "foreach" not in kwargs:
            kwargs.update(_fast_path(params))
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        kwargs.setdefault("weight_decay", 0.0)  # DeepSpeed's default (torch's AdamW uses 0.01)
        return cls(params, **kwargs)
    if "foreach" not in kwargs:
        kwargs["foreach"] = True
    cls = torch.optim.SGD if name == "sgd" else torch.optim.Adagrad
    return cls(params, **kwargs)
