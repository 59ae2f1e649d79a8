"""``GatheredParameters``: full parameters for a while, under any ZeRO stage."""

from __future__ import annotations

import contextlib

import torch

from shardwise.zero._init import gather_init_params, init_shard, release_init_params


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):  # noqa: N802
    """Make partitioned (stage 3) parameters whole inside the ``with`` block.

    Collective: every rank must enter it with the same parameters. Outside stage 3
    parameters are already whole and this does nothing. With ``modifier_rank`` set, the
    values that rank holds at exit (after in-place changes) are broadcast and become the
    new partitioned parameters on every rank; otherwise changes are discarded.

    Args:
        params: a parameter or an iterable of parameters (e.g. ``module.parameters()``).
        modifier_rank: the rank whose modifications are kept, or None.
        fwd_module: accepted for DeepSpeed compatibility; unused.
        enabled: False makes the context a no-op.
    """
    del fwd_module
    if isinstance(params, torch.Tensor):
        params = [params]
    units: dict[int, tuple] = {}
    built_partitioned = []  # zero.Init parameters no engine has adopted yet
    for p in params if enabled else ():
        owner = getattr(p, "_shardwise_unit", None)
        if owner is not None:
            units.setdefault(id(owner[1]), owner)
        elif init_shard(p) is not None and all(p is not q for q in built_partitioned):
            built_partitioned.append(p)
    by_strategy: dict[int, tuple] = {}
    for strategy, unit in units.values():
        by_strategy.setdefault(id(strategy), (strategy, []))[1].append(unit)
    for strategy, group in by_strategy.values():
        group.sort(key=lambda u: u.index)  # the same order on every rank
        strategy.gather_units(group)
    gather_init_params(built_partitioned)
    try:
        yield
    finally:
        for strategy, group in by_strategy.values():
            strategy.release_units(group, modifier_rank=modifier_rank)
        release_init_params(built_partitioned, modifier_rank=modifier_rank)


def register_external_parameter(module, parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter`` although another module owns it.

    Under stage 3 the owner's unit is then gathered before ``module`` runs too (a parameter
    is otherwise gathered only around its owner's forward). Outside stage 3 this does
    nothing, so the call can stay in model code.
    """
    owner = getattr(parameter, "_shardwise_unit", None)
    if owner is not None:
        strategy, unit = owner
        strategy.add_external_user(module, unit)
        return
    pending = module.__dict__.setdefault("_shardwise_external_params", [])
    pending.append(parameter)
