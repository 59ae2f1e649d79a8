"""``get_model_profile``: profile one forward (or ``generate``) call of a model."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.profiling.flops_profiler._profiler import FlopsProfiler
from shardwise.profiling.flops_profiler._report import check_print_args
from shardwise.profiling.flops_profiler._units import macs_to_string, number_to_string, params_to_string

_MODES = ("forward", "generate")


def _example_input(model: nn.Module, input_shape) -> torch.Tensor:
    if not isinstance(input_shape, tuple) or not input_shape:
        raise ValueError(
            f"input_shape must be a non-empty tuple such as (batch, features), got {input_shape!r}; "
            "pass args= or kwargs= for models that take other inputs"
        )
    param = next(model.parameters(), None)
    if param is None:
        return torch.zeros(input_shape)
    return torch.zeros(input_shape, dtype=param.dtype, device=param.device)


def get_model_profile(
    model,
    input_shape=None,
    args=None,
    kwargs=None,
    print_profile=True,
    detailed=True,
    module_depth=-1,
    top_modules=1,
    warm_up=1,
    as_string=True,
    output_file=None,
    ignore_modules=None,
    mode="forward",
):
    """FLOPs, MACs and parameters of one call of ``model``: ``(flops, macs, params)``.

    Contract: puts ``model`` in eval mode, calls it ``warm_up`` times unprofiled (so
    latencies exclude first-call costs), then once under a ``FlopsProfiler``, prints the
    profile if asked and removes every hook before returning. FLOPs and MACs are of that
    one call (see [Note: how FLOPs are counted]); params are full-size, tied weights once.
    The signature and defaults are DeepSpeed's, so ``as_string`` defaults to True.

    Example::

        flops, macs, params = get_model_profile(model, input_shape=(8, 3, 224, 224))

    Args:
        model: the module to profile.
        input_shape: shape of a single zero tensor (the model's parameter dtype and
            device) passed as the only positional argument; replaces ``args``.
        args: positional arguments of the call.
        kwargs: keyword arguments of the call.
        print_profile: print the profile (DeepSpeed's layout).
        detailed: include the module tree in the printed profile.
        module_depth: deepest module level printed; -1 prints all.
        top_modules: module classes listed per depth in the printed profile.
        warm_up: unprofiled calls made first.
        as_string: return ``("1.2 G", "0.6 GMACs", "3.4 M")`` instead of numbers.
        output_file: write the profile to this file instead of stdout.
        ignore_modules: module classes that get no hooks of their own (their numbers are
            their children's, and still count in their parents).
        mode: ``"forward"`` calls ``model(...)``; ``"generate"`` calls ``model.generate(...)``.

    Raises:
        ValueError: no inputs, a malformed ``input_shape``, an unknown ``mode``, or bad
            print settings.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    check_print_args(module_depth=module_depth, top_modules=top_modules)
    args = [_example_input(model, input_shape)] if input_shape is not None else list(args or [])
    kwargs = dict(kwargs or {})
    if not args and not kwargs:
        raise ValueError("get_model_profile needs the model's inputs: pass input_shape=, args= or kwargs=")
    call = model.generate if mode == "generate" else model
    model.eval()
    for _ in range(warm_up):
        call(*args, **kwargs)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        call(*args, **kwargs)
        prof.stop_profile()
        flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
        if print_profile:
            prof.print_model_profile(
                profile_step=warm_up,
                module_depth=module_depth,
                top_modules=top_modules,
                detailed=detailed,
                output_file=output_file,
            )
    finally:
        prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
