"""The text of a FLOPs profile, in DeepSpeed's layout.

[Note: the profile's text is an interface]
Users' tools parse DeepSpeed's profile, so the labels, their order, the 70-column label
field, the section rulers and the per-module item order ("params = x% Params, MACs =
y% MACs, latency = z% latency, FLOPS, then the module's own repr") are kept as
DeepSpeed prints them. Measured backward FLOPs add labelled lines of their own ("bwd
flops per GPU:", "fwd+bwd flops per GPU:", "fwd+bwd latency:"). Explanatory prose is our
own. Two departures: the top-modules section lists every depth down to
``module_depth`` including the deepest, and the module tree stops at ``module_depth``
(DeepSpeed prints the whole tree).
"""

from __future__ import annotations

import logging
import os
import sys

from torch import nn

from shardwise.profiling.flops_profiler._units import (
    DEFAULT_PRECISION,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

logger = logging.getLogger("shardwise")

_LINE = "{:<70}  {:<8}"
_RULER = "------------------------------------------------------------------------------"
_NOTATIONS = """Notations:
params: parameters; MACs: multiply-accumulate operations; flops: floating-point operations;
FLOPS: floating-point operations per second; dp_size / mp_size: data / model parallel size;
fwd, bwd and step latency: time in the forward, the backward and the weight update;
iter latency: fwd + bwd + step latency
"""
_TREE_NOTES = """Each module is followed by its numbers in this order:
params, share of total params, MACs, share of total MACs, fwd latency, share of total fwd latency, fwd FLOPS

Notes: 1. FLOPs are counted by torch.utils.flop_counter: matrix multiplies, convolutions and
attention (MACs = FLOPs / 2); elementwise ops are not counted. Functional code in a
module's forward (for example a loss) counts in that module, so a parent can exceed the
sum of its children.
2. FLOPs are the operations the kernels must do; FLOPS derived from them can exceed what
the hardware sustains when kernels skip work.
3. The top module's fwd latency is timed at its forward call and can be shorter than the
engine's fwd latency above.
"""


def check_print_args(*, module_depth: int, top_modules: int) -> None:
    """Refuse print settings that select nothing.

    Raises:
        ValueError: ``module_depth`` < -1 or ``top_modules`` < 1, naming the value.
    """
    if not isinstance(module_depth, int) or module_depth < -1:
        raise ValueError(f"module_depth must be -1 (all levels) or a depth >= 0, got {module_depth!r}")
    if not isinstance(top_modules, int) or top_modules < 1:
        raise ValueError(f"top_modules must be an integer >= 1, got {top_modules!r}")


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _engine_lines(engine) -> list[str]:
    mp_size = getattr(engine, "mp_world_size", 1)
    return [
        _LINE.format("world size: ", getattr(engine, "world_size", 1)),
        _LINE.format("data parallel size: ", getattr(engine, "dp_world_size", 1)),
        _LINE.format("model parallel size: ", mp_size),
        _LINE.format("batch size per GPU: ", engine.train_micro_batch_size_per_gpu()),
    ]


def _step_lines(prof, fwd_flops: int) -> list[str]:
    """The training-step block: backward, fwd+bwd, step and iteration."""
    timing = prof.step_timing
    if prof.recompute_fwd_factor:
        logger.warning(
            "flops_profiler.recompute_fwd_factor=%g is not used: the backward FLOPs are "
            "measured, recomputation included; set it to 0",
            prof.recompute_fwd_factor,
        )
    both_flops = fwd_flops + timing.bwd_flops
    both_latency = timing.fwd_latency + timing.bwd_latency
    iter_latency = both_latency + timing.step_latency
    lines = [
        _LINE.format("bwd latency: ", duration_to_string(timing.bwd_latency)),
        _LINE.format("bwd flops per GPU: ", number_to_string(timing.bwd_flops)),
        _LINE.format(
            "bwd FLOPS per GPU = bwd flops per GPU / bwd latency: ",
            flops_to_string(_ratio(timing.bwd_flops, timing.bwd_latency)),
        ),
        _LINE.format("fwd+bwd flops per GPU: ", number_to_string(both_flops)),
        _LINE.format("fwd+bwd latency: ", duration_to_string(both_latency)),
        _LINE.format(
            "fwd+bwd FLOPS per GPU = fwd+bwd flops per GPU / (fwd+bwd latency): ",
            flops_to_string(_ratio(both_flops, both_latency)),
        ),
        _LINE.format("step latency: ", duration_to_string(timing.step_latency)),
        _LINE.format("iter latency: ", duration_to_string(iter_latency)),
        _LINE.format(
            "FLOPS per GPU = fwd+bwd flops per GPU / iter latency: ", flops_to_string(_ratio(both_flops, iter_latency))
        ),
        _LINE.format("achieved TFLOP/s per GPU: ", f"{_ratio(both_flops, iter_latency) / 1e12:.4g}"),
    ]
    if prof.ds_engine is not None:
        samples = prof.ds_engine.train_micro_batch_size_per_gpu() * getattr(prof.ds_engine, "world_size", 1)
        lines.append(_LINE.format("samples/second: ", round(_ratio(samples, iter_latency), DEFAULT_PRECISION)))
    return lines


def _summary_lines(prof, profile_step: int) -> list[str]:
    engine = prof.ds_engine
    mp_size = getattr(engine, "mp_world_size", 1) if engine is not None else 1
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    timing = prof.step_timing
    fwd_latency = timing.fwd_latency if timing is not None else prof.get_total_duration()
    lines = [
        "",
        "-------------------------- DeepSpeed Flops Profiler --------------------------",
        f"Profile Summary at step {profile_step}:",
        _NOTATIONS,
    ]
    if engine is not None:
        lines += _engine_lines(engine)
    lines += [
        _LINE.format("params per GPU: ", params_to_string(params)),
        _LINE.format("params of model = params per GPU * mp_size: ", params_to_string(params * mp_size)),
        _LINE.format("fwd MACs per GPU: ", macs_to_string(macs)),
        _LINE.format("fwd flops per GPU: ", number_to_string(flops)),
        _LINE.format("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops * mp_size)),
        _LINE.format("fwd latency: ", duration_to_string(fwd_latency)),
        _LINE.format(
            "fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(_ratio(flops, fwd_latency))
        ),
    ]
    if timing is not None:
        lines += _step_lines(prof, flops)
    return lines


def _aggregated_lines(prof, module_depth: int, top_modules: int) -> list[str]:
    """Per depth, the module classes with the most params, MACs and latency (summed per class)."""
    per_depth: list[dict[str, list[float]]] = []

    def walk(module: nn.Module, depth: int) -> None:
        if depth == len(per_depth):
            per_depth.append({})
        totals = per_depth[depth].setdefault(type(module).__name__, [0, 0, 0.0])
        totals[0] += prof.module_params(module)
        totals[1] += prof.module_macs(module)
        totals[2] += prof.module_duration(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(prof.model, 0)
    deepest = len(per_depth) - 1 if module_depth == -1 else min(module_depth, len(per_depth) - 1)
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in range(deepest + 1):
        rows = per_depth[depth]

        def top(index: int, to_string) -> dict[str, str]:
            ranked = sorted(rows.items(), key=lambda item: item[1][index], reverse=True)[:top_modules]
            return {name: to_string(values[index]) for name, values in ranked}

        lines += [
            f"depth {depth}:",
            f"    params      - {top(0, params_to_string)}",
            f"    MACs        - {top(1, macs_to_string)}",
            f"    fwd latency - {top(2, duration_to_string)}",
        ]
    return lines


def _percent(part: float, whole: float) -> str:
    return f"{round(100 * part / whole, DEFAULT_PRECISION) if whole else 0:g}%"


def _module_items(prof, module: nn.Module, totals: tuple[int, int, float]) -> str:
    params, macs = prof.module_params(module), prof.module_macs(module)
    flops, duration = prof.module_flops(module), prof.module_duration(module)
    items = [
        f"{params_to_string(params)} = {_percent(params, totals[0])} Params",
        f"{macs_to_string(macs)} = {_percent(macs, totals[1])} MACs",
        f"{duration_to_string(duration)} = {_percent(duration, totals[2])} latency",
        flops_to_string(round(_ratio(flops, duration), DEFAULT_PRECISION)),
    ]
    own = module.extra_repr()
    if own:
        items.append(own)
    return ", ".join(items)


def module_tree(prof, module: nn.Module, *, module_depth: int, totals: tuple[int, int, float], depth: int = 0) -> str:
    """``module`` printed as ``nn.Module.__repr__`` does, each module's numbers first in
    its parentheses; children deeper than ``module_depth`` (-1: none) are left out."""
    own = _module_items(prof, module, totals)
    children = list(module.named_children()) if module_depth == -1 or depth < module_depth else []
    if not children:
        return f"{type(module).__name__}({own})"
    lines = [own]
    for name, child in children:
        text = module_tree(prof, child, module_depth=module_depth, totals=totals, depth=depth + 1)
        lines.append(f"({name}): " + text.replace("\n", "\n  "))
    return f"{type(module).__name__}(\n  " + "\n  ".join(lines) + "\n)"


def profile_text(prof, *, profile_step: int, module_depth: int, top_modules: int, detailed: bool) -> str:
    """The whole profile of a ``FlopsProfiler`` (arguments as its ``print_model_profile``)."""
    lines = _summary_lines(prof, profile_step)
    lines += ["", "----------------------------- Aggregated Profile per GPU -----------------------------"]
    lines += _aggregated_lines(prof, module_depth, top_modules)
    if detailed:
        totals = (prof.get_total_params(), prof.get_total_macs(), prof.get_total_duration())
        lines += [
            "",
            "------------------------------ Detailed Profile per GPU ------------------------------",
            _TREE_NOTES,
            module_tree(prof, prof.model, module_depth=module_depth, totals=totals),
        ]
    lines.append(_RULER)
    return "\n".join(lines) + "\n"


def write_profile(
    prof, *, profile_step: int, module_depth: int, top_modules: int, detailed: bool, output_file: str | None
) -> None:
    """Print the profile to stdout, or write it to ``output_file`` (folders created)."""
    text = profile_text(
        prof, profile_step=profile_step, module_depth=module_depth, top_modules=top_modules, detailed=detailed
    )
    if not output_file:
        sys.stdout.write(text)
        return
    os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
    with open(output_file, "w", encoding="utf-8") as stream:
        stream.write(text)
