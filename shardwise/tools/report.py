"""``shardwise report``: what a bug report or an install check needs to know."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import shutil
import sys


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as exc:  # noqa: BLE001 - a broken install is worth reporting, not crashing on
        return f"broken ({type(exc).__name__}: {exc})"


def collect() -> list[tuple[str, str]]:
    """(item, value) rows of the report."""
    import torch
    import torch.distributed as dist

    import shardwise

    rows = [
        ("shardwise", f"{shardwise.__version__} ({os.path.dirname(shardwise.__file__)})"),
        ("torch", f"{torch.__version__} ({os.path.dirname(torch.__file__)})"),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", platform.platform()),
        ("cpu count", str(os.cpu_count())),
    ]
    if torch.cuda.is_available():
        rows.append(("cuda", f"{torch.version.cuda}, {torch.cuda.device_count()} device(s)"))
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            rows.append((f"  gpu {index}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB"))
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None
        rows.append(("nccl", nccl or "not available"))
        rows.append(("bf16 on gpu", "yes" if torch.cuda.is_bf16_supported() else "no"))
    else:
        rows.append(("cuda", "not available (training runs on CPU with gloo)"))
    rows.append(
        (
            "gloo",
            "available" if dist.is_gloo_available() else "NOT available: CPU training needs a torch build with gloo",
        )
    )
    rows.append(
        (
            "mpi backend",
            "available"
            if dist.is_mpi_available()
            else "not built into torch (not needed: mpirun can still launch ranks)",
        )
    )
    optional = [
        ("tensorboard", "tensorboard", "TensorBoard monitor (pip install tensorboard)"),
        ("wandb", "wandb", "Weights & Biases monitor (pip install wandb)"),
        ("transformers", "transformers", "Hugging Face models (pip install transformers)"),
        ("triton", "triton", "compiles sparse attention's FlexAttention kernels on CUDA (ships with CUDA torch)"),
        ("safetensors", "safetensors", "checkpoint files (required)"),
    ]
    for name, module, purpose in optional:
        version = _version(module)
        rows.append((name, version if version else f"not installed: {purpose}"))
    rows.append(
        (
            "ZeRO stages",
            "0-3; optimizer offload to CPU or NVMe at stages 1-3, parameter offload to CPU or NVMe at stage 3",
        )
    )
    for tool in ("ssh", "pdsh", "srun", "mpirun"):
        rows.append((f"launcher: {tool}", shutil.which(tool) or "not found"))
    return rows


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="shardwise report", description=__doc__).parse_args(argv)
    rows = collect()
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0
