"""``FlopsProfiler``: FLOPs, MACs, parameters and forward latency of a model and each module.

[Note: how FLOPs are counted]
One ``torch.utils.flop_counter.FlopCounterMode`` runs while the profile is started. It
sees every aten op (functional code, ``F.scaled_dot_product_attention``, backward) and
counts the ops in PyTorch's FLOP registry: matrix multiplies (mm, addmm, bmm, baddbmm,
scaled mm), convolutions and attention, forward and backward (plus the CPU attention
kernels it lacks, see [Note: CPU attention kernels] in ``_formulas.py``). Each counted op is a
multiply-accumulate kernel, so MACs = FLOPs / 2 exactly. Elementwise ops (activations,
norms, softmax, bias adds) are not counted; DeepSpeed's monkeypatched estimates add a
few of those, so its totals are slightly larger for the same model.

A module's FLOPs are the counter's growth between its forward pre-hook and its forward
hook, summed over its calls: inclusive of its children and of functional code in its own
forward. A module whose forward never ran while profiling (a ``ModuleList``, a module in
``ignore_list``) reports the sum of its children, as does its latency.

[Note: parameters of partitioned models]
Every parameter is counted once per module that owns it (``module.parameters()``
deduplicates tied weights) at its full size: a ZeRO-3 parameter holds only its shard
between forwards, so its size is read from ``ds_numel``, the full element count
shardwise records on it (DeepSpeed's name).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from shardwise.accelerator import get_accelerator
from shardwise.profiling.flops_profiler._formulas import extra_formulas
from shardwise.profiling.flops_profiler._report import check_print_args, write_profile
from shardwise.profiling.flops_profiler._units import (
    duration_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

logger = logging.getLogger("shardwise")


@dataclasses.dataclass
class _ModuleStats:
    """What the hooks measured for one module during the profile."""

    params: int
    flops: int = 0
    duration: float = 0.0
    calls: int = 0
    open_calls: list = dataclasses.field(default_factory=list)  # (flops, time) at each unfinished pre-hook


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """Latencies and backward FLOPs of one profiled training step (set by ``StepProfiler``)."""

    fwd_latency: float
    """Seconds in the engine's forward."""
    bwd_latency: float
    """Seconds in the engine's backward."""
    step_latency: float
    """Seconds in the engine's step (optimizer update at an accumulation boundary)."""
    bwd_flops: int
    """FLOPs counted during the backward, activation recomputation included."""


@functools.cache
def _warm_up_counter() -> None:
    """Count one tiny matmul: the first op a process counts pays about a second of lazy
    imports, which would otherwise land in the first profiled module's latency."""
    with FlopCounterMode(display=False, custom_mapping=extra_formulas()):
        torch.mm(torch.ones(1, 1), torch.ones(1, 1))


def full_numel(param: nn.Parameter) -> int:
    """Elements of ``param`` as the model sees it, also while ZeRO-3 holds only a shard
    (see [Note: parameters of partitioned models])."""
    return int(getattr(param, "ds_numel", param.numel()))


class FlopsProfiler:
    """Measures FLOPs, MACs, parameters and forward latency of ``model`` and its modules.

    Contract: ``start_profile()`` starts a FLOP counter (see [Note: how FLOPs are
    counted]) and adds forward hooks to every module; each forward that runs before
    ``stop_profile()`` adds to the counts. ``stop_profile()`` removes the hooks and stops
    counting, keeping the numbers for the getters and ``print_model_profile``;
    ``end_profile()`` also drops them. Nothing in the model is changed: no attributes are
    set on modules and no torch function is replaced. Counting slows every op a little,
    so latencies measured while profiling are slightly pessimistic.

    Example::

        prof = FlopsProfiler(model)
        prof.start_profile()
        model(batch)
        flops = prof.get_total_flops()
        prof.print_model_profile(profile_step=1)
        prof.end_profile()

    Args:
        model: the module to profile.
        ds_engine: the engine driving ``model``, if any; the printed summary then states
            the world, data-parallel and model-parallel sizes and the micro-batch size
            read from it.
        recompute_fwd_factor: DeepSpeed's share of the forward recomputed in the backward
            (activation checkpointing), used to estimate backward FLOPs. Backward FLOPs
            measured by ``StepProfiler`` already include recomputation, and then this value
            is not used.
    """

    def __init__(self, model: nn.Module, ds_engine=None, recompute_fwd_factor: float = 0.0):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self.step_timing: StepTiming | None = None
        """Set by ``StepProfiler`` for a training step; adds the backward and step lines."""
        self._counter: FlopCounterMode | None = None
        self._handles: list = []
        self._stats: dict[nn.Module, _ModuleStats] = {}

    # -- lifecycle --------------------------------------------------------------------------

    def start_profile(self, ignore_list=None) -> None:
        """Reset the counts, start the FLOP counter and hook every module's forward.

        Args:
            ignore_list: module classes that get no hooks; their FLOPs and latency are
                reported as the sum of their children's and still count in their parents.
        """
        if self.started:
            self.stop_profile()
        self.reset_profile()
        self.step_timing = None
        ignored = tuple(ignore_list or ())
        _warm_up_counter()
        sync = get_accelerator().synchronize
        for module in self.model.modules():
            if ignored and isinstance(module, ignored):
                continue
            stats = self._stats[module]
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(stats, sync)))
            self._handles.append(module.register_forward_hook(self._post_hook(stats, sync), always_call=True))
        self._counter = FlopCounterMode(display=False, custom_mapping=extra_formulas())
        self._counter.__enter__()
        self.started = True
        logger.debug("flops profiler started")

    def remove_hooks(self) -> None:
        """Stop attributing forwards to modules; the FLOP counter keeps counting."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def stop_profile(self) -> None:
        """Stop counting and remove the hooks; the measured numbers stay readable."""
        self.remove_hooks()
        if self._counter is not None:
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)

    def reset_profile(self) -> None:
        """Zero every module's counts and latency and re-read the parameter counts."""
        self._stats = {
            module: _ModuleStats(params=sum(full_numel(p) for p in module.parameters()))
            for module in self.model.modules()
        }

    def end_profile(self) -> None:
        """Stop profiling and drop the measurements."""
        if not self.started:
            return
        self.stop_profile()
        self._stats = {}
        self.started = False
        logger.debug("flops profiler finished")

    def counted_flops(self) -> int:
        """FLOPs the counter has seen since ``start_profile`` (forward, backward and any op
        outside modules), 0 when not counting; ``StepProfiler`` reads it at phase edges."""
        return self._counter.get_total_flops() if self._counter is not None else 0

    def _pre_hook(self, stats: _ModuleStats, sync):
        def hook(module, args):
            sync()
            stats.open_calls.append((self.counted_flops(), time.perf_counter()))

        return hook

    def _post_hook(self, stats: _ModuleStats, sync):
        def hook(module, args, output):
            if not stats.open_calls:  # the profile started inside this module's forward
                return
            sync()
            flops, start = stats.open_calls.pop()
            stats.duration += time.perf_counter() - start
            stats.flops += self.counted_flops() - flops
            stats.calls += 1

        return hook

    # -- per-module numbers -----------------------------------------------------------------

    def module_flops(self, module: nn.Module) -> int:
        """Forward FLOPs of ``module`` and its children (see [Note: how FLOPs are counted])."""
        stats = self._stats.get(module)
        if stats is not None and stats.calls:
            return stats.flops
        return sum(self.module_flops(child) for child in module.children())

    def module_macs(self, module: nn.Module) -> int:
        """Forward MACs of ``module``: half its FLOPs (every counted op is a MAC kernel)."""
        return self.module_flops(module) // 2

    def module_duration(self, module: nn.Module) -> float:
        """Seconds in ``module``'s forward, or its children's when it was not called."""
        stats = self._stats.get(module)
        if stats is not None and stats.calls:
            return stats.duration
        return sum(self.module_duration(child) for child in module.children())

    def module_params(self, module: nn.Module) -> int:
        """Full-size parameters of ``module`` and its children, tied ones once."""
        stats = self._stats.get(module)
        if stats is not None:
            return stats.params
        return sum(full_numel(p) for p in module.parameters())

    # -- totals (DeepSpeed's getters) -----------------------------------------------------------

    def get_total_flops(self, as_string: bool = False):
        """Forward FLOPs of the model (``"1.2 G"`` when ``as_string``)."""
        flops = self.module_flops(self.model)
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False):
        """Forward MACs of the model (``"0.6 GMACs"`` when ``as_string``)."""
        macs = self.module_macs(self.model)
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False):
        """Parameters of the model at full size, tied ones once (``"1.2 M"`` when ``as_string``)."""
        params = self.module_params(self.model)
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False):
        """Seconds in the model's forward (``"12.5 ms"`` when ``as_string``)."""
        duration = self.module_duration(self.model)
        return duration_to_string(duration) if as_string else duration

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Print the summary, the top modules per depth and (when ``detailed``) the module
        tree with each module's numbers, in DeepSpeed's layout. Does nothing unless the
        profile was started.

        Args:
            profile_step: the step number printed in the header.
            module_depth: deepest module level shown (the root is 0); -1 shows all levels.
            top_modules: how many module classes to list per depth, by params, MACs and
                forward latency.
            detailed: also print the module tree.
            output_file: write to this file (its folder is created) instead of stdout.

        Raises:
            ValueError: ``module_depth`` < -1 or ``top_modules`` < 1.
        """
        check_print_args(module_depth=module_depth, top_modules=top_modules)
        if not self.started:
            return
        write_profile(
            self,
            profile_step=profile_step,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
