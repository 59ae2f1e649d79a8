"""One place that knows which device and communication backend this process uses.

Everything else asks the accelerator instead of calling ``torch.cuda`` directly, so the
CPU (gloo) path that the tests exercise and the CUDA (NCCL) production path share code.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Accelerator:
    """The device kind of this process and the backend its collectives use."""

    device_type: str
    """``"cuda"`` or ``"cpu"``."""
    backend: str
    """``"nccl"`` for CUDA, ``"gloo"`` for CPU."""

    def device(self, local_rank: int | None = None) -> torch.device:
        """The device this rank computes on (``cuda:<local_rank>`` or ``cpu``)."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        if local_rank is None:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cuda", local_rank)

    def set_device(self, local_rank: int) -> None:
        """Bind this process to its local device (no-op on CPU)."""
        if self.device_type == "cuda":
            torch.cuda.set_device(local_rank % max(torch.cuda.device_count(), 1))

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU), e.g. before reading a timer."""
        if self.device_type == "cuda":
            torch.cuda.synchronize()

    def side_stream(self):
        """A context that runs work on a secondary stream where the device has one."""
        if self.device_type == "cuda":
            return torch.cuda.stream(torch.cuda.Stream())
        return contextlib.nullcontext()

    def supports_fused_optimizers(self) -> bool:
        """Whether torch's ``fused=True`` optimizer kernels apply to this device."""
        return self.device_type == "cuda"


def get_accelerator() -> Accelerator:
    """Detect the accelerator: CUDA when present (override with SHARDWISE_ACCELERATOR=cpu)."""
    forced = os.environ.get("SHARDWISE_ACCELERATOR", "").strip().lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(
            f"SHARDWISE_ACCELERATOR must be 'cpu' or 'cuda', got {forced!r}; unset it to auto-detect"
        )
    use_cuda = forced == "cuda" or (forced == "" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("SHARDWISE_ACCELERATOR=cuda but torch.cuda.is_available() is False")
    return Accelerator("cuda", "nccl") if use_cuda else Accelerator("cpu", "gloo")
