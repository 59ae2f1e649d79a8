"""One parameter's fp32 master, gradient and optimizer state, whatever the ZeRO stage:
DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` / ``safe_*_local_*`` functions.

Each trainable parameter points to the strategy that holds its state
(``param._shardwise_strategy``, a weakref set by every stage); the strategy does the
work (see ``ZeroViews.full_param_state``). The ``full`` functions are collective at
stages 1-3 (the state is gathered from every rank's shard): call them on every rank with
the same parameter. A parameter no engine trains gives None, as in DeepSpeed.
"""

from __future__ import annotations

import torch

from shardwise.zero._strategy import GRAD_KEY, MASTER_KEY


def _strategy(param: torch.Tensor):
    ref = getattr(param, "_shardwise_strategy", None)
    return None if ref is None else ref()


def _get(param, key: str, *, local: bool) -> torch.Tensor | None:
    strategy = _strategy(param)
    if strategy is None:
        return None
    return strategy.views.local_param_state(param, key) if local else strategy.views.full_param_state(param, key)


def _set(param, value: torch.Tensor, key: str, *, local: bool) -> None:
    strategy = _strategy(param)
    if strategy is None:
        raise ValueError(
            "this parameter is not trained by a shardwise engine; "
            "pass a parameter of the model given to shardwise.initialize()"
        )
    strategy.views.set_param_state(param, key, value, local=local)


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master weight of ``param`` (a copy). Collective at stages 1-3."""
    return _get(param, MASTER_KEY, local=False)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace ``param``'s fp32 master weight with ``value`` (full shape) and refresh the
    parameter from it. Collective at stages 1-3."""
    _set(param, value, MASTER_KEY, local=False)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The whole optimizer state ``optim_state_key`` (``exp_avg``...) of ``param``, or None
    before the optimizer has made it. Collective at stages 1-3."""
    return _get(param, optim_state_key, local=False)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Replace ``param``'s optimizer state ``optim_state_key`` with ``value`` (full shape)."""
    _set(param, value, optim_state_key, local=False)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """``param``'s whole gradient after ``engine.backward`` at an accumulation boundary and
    before ``engine.step``: reduced across ranks, in the dtype it is accumulated in and,
    under fp16, still multiplied by the loss scale (as DeepSpeed's). Collective at 1-3."""
    return _get(param, GRAD_KEY, local=False)


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace ``param``'s reduced gradient with ``value`` (full shape) before the step."""
    _set(param, value, GRAD_KEY, local=False)


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The part of ``param``'s fp32 master this rank holds, flattened (maybe empty)."""
    return _get(param, MASTER_KEY, local=True)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace this rank's part of ``param``'s fp32 master (the shape
    ``safe_get_local_fp32_param`` gives). Collective at stages 1-3 (the parameters are
    refreshed from the masters)."""
    _set(param, value, MASTER_KEY, local=True)


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The part of ``param``'s optimizer state this rank holds, flattened."""
    return _get(param, optim_state_key, local=True)


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Replace this rank's part of ``param``'s optimizer state."""
    _set(param, value, optim_state_key, local=True)


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The part of ``param``'s reduced gradient this rank holds, flattened."""
    return _get(param, GRAD_KEY, local=True)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace this rank's part of ``param``'s reduced gradient."""
    _set(param, value, GRAD_KEY, local=True)


__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
]
