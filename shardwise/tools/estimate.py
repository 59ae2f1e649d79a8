"""``shardwise estimate``: model-state memory per device for ZeRO stages 0-3.

Model states are parameters, gradients and optimizer state (Adam: two moments, plus fp32
master weights under mixed precision). For Psi parameters on N data-parallel ranks:

| stage | per device (bytes) |
| --- | --- |
| 0 | (p + g + o) Psi |
| 1 | (p + g) Psi + o Psi / N |
| 2 | p Psi + (g + o) Psi / N |
| 3 | (p + g + o) Psi / N |

with p = g = 4, o = 8 in fp32 and p = g = 2, o = 12 in fp16/bf16. Offloading the
optimizer moves the ``o`` term (and, from stage 2, the fp32 gradient copy it needs) to
CPU memory; offloading parameters (stage 3) moves the rest. Activations and temporary
buffers come on top and depend on batch size and sequence length.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import dataclass

import torch

_BYTES = {"fp32": (4, 4, 8), "fp16": (2, 2, 12), "bf16": (2, 2, 12)}


@dataclass(frozen=True)
class Estimate:
    """Model-state bytes for one setting."""

    stage: int
    offload_optimizer: bool
    offload_param: bool
    device_bytes: float
    """Per device (GPU, or CPU process when training on CPU)."""
    cpu_bytes_per_node: float
    """Offloaded states held in each node's CPU memory."""


def estimate(
    num_params: int,
    *,
    num_nodes: int = 1,
    devices_per_node: int = 1,
    dtype: str = "fp16",
    stage: int,
    offload_optimizer: bool = False,
    offload_param: bool = False,
) -> Estimate:
    """Closed-form model-state memory of one ZeRO setting (see the module docstring).

    Args:
        num_params: trainable parameters (Psi).
        num_nodes: machines.
        devices_per_node: data-parallel ranks per machine.
        dtype: ``fp32``, ``fp16`` or ``bf16``.
        stage: ZeRO stage 0-3.
        offload_optimizer: optimizer state (and its fp32 gradients) in CPU memory.
        offload_param: parameters in CPU memory too (stage 3 only).
    """
    if dtype not in _BYTES:
        raise ValueError(f"dtype must be fp32, fp16 or bf16, got {dtype!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0..3, got {stage}")
    if offload_param and stage != 3:
        raise ValueError("offload_param needs stage 3")
    p, g, o = _BYTES[dtype]
    n = num_nodes * devices_per_node
    psi = float(num_params)
    shard = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[stage]
    terms = {"p": p * psi / shard[0], "g": g * psi / shard[1], "o": o * psi / shard[2]}
    on_cpu = set()
    if offload_optimizer:
        on_cpu.add("o")
    if offload_param:
        on_cpu.update({"p", "g"})
    device = sum(v for k, v in terms.items() if k not in on_cpu)
    cpu = sum(v for k, v in terms.items() if k in on_cpu) * devices_per_node
    return Estimate(stage, offload_optimizer, offload_param, device, cpu)


def all_settings(num_params: int, **kwargs) -> list[Estimate]:
    """Every stage with and without optimizer offload, and stage 3 with parameter offload."""
    rows = []
    for stage in range(4):
        for offload in (False, True):
            if stage == 0 and offload:
                continue
            rows.append(estimate(num_params, stage=stage, offload_optimizer=offload, **kwargs))
    rows.append(estimate(num_params, stage=3, offload_optimizer=True, offload_param=True, **kwargs))
    return rows


def count_params(model_path: str, model_args: dict) -> int:
    """Parameters of ``module:Class(**model_args)``, built on the meta device (no memory)."""
    module_name, _, attr = model_path.partition(":")
    if not attr:
        raise ValueError(f"--model must look like package.module:ClassOrFunction, got {model_path!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {model_path!r}: {exc}") from None
    with torch.device("meta"):
        model = factory(**model_args)
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _size(value: str) -> float:
    units = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    value = value.strip().lower()
    if value and value[-1] in units:
        return float(value[:-1]) * units[value[-1]]
    return float(value)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="shardwise estimate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=_size, help="parameter count, e.g. 1.3b or 350m")
    source.add_argument("--model", help="package.module:Class built on the meta device to count parameters")
    parser.add_argument("--model_args", default="{}", help="JSON keyword arguments for --model")
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--num_gpus", "--devices_per_node", type=int, default=1, dest="devices")
    parser.add_argument("--dtype", default="fp16", choices=sorted(_BYTES))
    parser.add_argument(
        "--device_memory", type=_size, default=None, help="bytes per device (e.g. 80g) to say which settings fit"
    )
    args = parser.parse_args(argv)
    try:
        num_params = int(args.params) if args.params else count_params(args.model, json.loads(args.model_args))
    except (ValueError, TypeError) as exc:
        print(f"shardwise estimate: {exc}", file=sys.stderr)
        return 2
    rows = all_settings(num_params, num_nodes=args.num_nodes, devices_per_node=args.devices, dtype=args.dtype)
    print(
        f"{num_params / 1e6:.1f}M parameters, {args.num_nodes} node(s) x {args.devices} device(s), "
        f"{args.dtype}; model states only (activations and buffers come on top)\n"
    )
    header = "| stage | offload | per device | CPU per node |" + (" fits |" if args.device_memory else "")
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for row in rows:
        offload = "optimizer+params" if row.offload_param else ("optimizer" if row.offload_optimizer else "none")
        line = f"| {row.stage} | {offload} | {_gib(row.device_bytes)} | {_gib(row.cpu_bytes_per_node)} |"
        if args.device_memory:
            line += " yes |" if row.device_bytes <= args.device_memory else " no |"
        print(line)
    return 0
