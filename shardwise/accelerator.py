"""One place that knows which device and communication backend this process uses.

Everything else asks the accelerator instead of calling ``torch.cuda`` directly, so the
CPU (gloo) path that the tests exercise and the CUDA (NCCL) production path share code.
DeepSpeed scripts reach it as ``from deepspeed.accelerator import get_accelerator``; the
methods keep the names, arguments and return values of DeepSpeed's CPU and CUDA
accelerators, so ``get_accelerator().device_name()`` or ``.memory_allocated()`` work as
there. On CPU, "memory" is this process's resident set size (RSS), as in DeepSpeed.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from shardwise._host_memory import host_available, host_memory, host_total


@dataclass(frozen=True)
class Accelerator:
    """The device kind of this process and the backend its collectives use.

    Methods that take ``device_index=None`` mean the current device; on CPU there is one
    device and the index is ignored.
    """

    device_type: str
    """``"cuda"`` or ``"cpu"``."""
    backend: str
    """``"nccl"`` for CUDA, ``"gloo"`` for CPU."""

    @property
    def _cuda(self) -> bool:
        return self.device_type == "cuda"

    # -- device -----------------------------------------------------------------------

    def device(self, device_index: int | None = None) -> torch.device:
        """The device this rank computes on (``cuda:<device_index>`` or ``cpu``)."""
        if not self._cuda:
            return torch.device("cpu")
        if device_index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cuda", device_index)

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` / ``"cuda:<i>"`` or ``"cpu"``."""
        if not self._cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device(self) -> int:
        """The current CUDA device index; on CPU the LOCAL_RANK (0 when unset)."""
        if self._cuda:
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK") or 0)

    def current_device_name(self) -> str:
        """``"cuda:<current>"`` or ``"cpu"``."""
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        """Visible CUDA devices; on CPU the LOCAL_SIZE processes per node (1 when unset)."""
        if self._cuda:
            return torch.cuda.device_count()
        return max(int(os.environ.get("LOCAL_SIZE") or 0), 1)

    def set_device(self, device_index: int) -> None:
        """Bind this process to its local device (no-op on CPU).

        The index wraps around the visible devices, so a local rank larger than the
        device count (several ranks per GPU) still binds.
        """
        if self._cuda:
            torch.cuda.set_device(device_index % max(torch.cuda.device_count(), 1))

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for queued device work (no-op on CPU), e.g. before reading a timer."""
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        """Whether the device can be used (always on CPU)."""
        return torch.cuda.is_available() if self._cuda else True

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device (``"nccl"`` / ``"gloo"``)."""
        return self.backend

    def is_synchronized_device(self) -> bool:
        """True when work finishes before the call returns (CPU); False for CUDA streams."""
        return not self._cuda

    def use_host_timers(self) -> bool:
        """Whether wall-clock timers measure device work (synchronous devices only)."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """Whether the device orders dependent work by itself (synchronous devices only)."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """Whether queued work cannot outrun memory (synchronous devices only)."""
        return self.is_synchronized_device()

    def supports_fused_optimizers(self) -> bool:
        """Whether torch's ``fused=True`` optimizer kernels apply to this device."""
        return self._cuda

    def is_triton_supported(self) -> bool:
        """Whether Triton kernels run here (CUDA compute capability 8 or newer)."""
        return self._cuda and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8

    # -- data types -----------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        """Whether bfloat16 compute is supported (always on CPU; True before CUDA is visible)."""
        if not self._cuda or not torch.cuda.is_available():
            return True
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """Whether float16 compute is fast: oneDNN fp16 on CPU, compute capability >= 7 on CUDA.

        DeepSpeed's DS_ALLOW_DEPRECATED_FP16=1 also admits capability 6.
        """
        if not self._cuda:
            try:
                return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
            except (AttributeError, RuntimeError):
                return False
        if not torch.cuda.is_available():
            return True
        major = torch.cuda.get_device_capability()[0]
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16") == "1")

    def supported_dtypes(self) -> list[torch.dtype]:
        """Floating dtypes for compute, in DeepSpeed's order for this device."""
        if not self._cuda:
            return [torch.float32, torch.bfloat16] + ([torch.float16] if self.is_fp16_supported() else [])
        return (
            [torch.float32]
            + ([torch.float16] if self.is_fp16_supported() else [])
            + ([torch.bfloat16] if self.is_bf16_supported() else [])
        )

    # -- memory (bytes); on CPU the process RSS, see shardwise._host_memory ----------------------

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes held by tensors on the device (CPU: current RSS)."""
        return torch.cuda.memory_allocated(device_index) if self._cuda else host_memory.current()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_allocated` since the last reset."""
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else host_memory.max()

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Restart the peak that :meth:`max_memory_allocated` reports."""
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            host_memory.reset()

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes held by the caching allocator (CPU: current RSS)."""
        return torch.cuda.memory_reserved(device_index) if self._cuda else host_memory.current()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_reserved` since the last reset."""
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else host_memory.max()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved
    reset_max_memory_cached = reset_max_memory_allocated
    reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict:
        """torch's allocator statistics; on CPU only current and peak allocated bytes."""
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": host_memory.current(), "allocated_bytes.all.peak": host_memory.max()}

    def total_memory(self, device_index: int | None = None) -> int:
        """The device's memory size (CPU: physical RAM)."""
        if self._cuda:
            return torch.cuda.get_device_properties(device_index).total_memory
        return host_total()

    def available_memory(self, device_index: int | None = None) -> int:
        """Free device memory (CPU: the kernel's MemAvailable estimate)."""
        if self._cuda:
            free, _ = torch.cuda.mem_get_info(device_index)
            return free
        return host_available()

    def empty_cache(self) -> None:
        """Return cached, unused device blocks to the driver (no-op on CPU)."""
        if self._cuda:
            torch.cuda.empty_cache()

    def pin_memory(
        self, tensor: torch.Tensor, align_bytes: int = 1, *, make_copy: bool = True, match_shape: bool = True
    ) -> torch.Tensor:
        """A page-locked copy of a host tensor for fast copies to CUDA; on CPU ``tensor`` itself.

        ``align_bytes`` (older DeepSpeed) and ``make_copy`` / ``match_shape`` (newer) are
        accepted; torch's pinning always copies and keeps the shape.
        """
        del align_bytes, make_copy, match_shape
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in page-locked host memory."""
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is on this accelerator's device type."""
        return tensor.device.type == self.device_type

    # -- random number generators ---------------------------------------------------

    def random(self):
        """torch's ``random`` module."""
        return torch.random

    def manual_seed(self, seed: int):
        """Seed the current device's generator (CPU: the default generator)."""
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        """Seed every device's generator (CPU: the default generator)."""
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def seed(self):
        """Seed the current device's generator from a non-deterministic source."""
        return torch.cuda.seed() if self._cuda else torch.seed()

    def initial_seed(self) -> int:
        """The seed the current device's generator started from."""
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The device generator's state as a byte tensor."""
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore a state from :meth:`get_rng_state`."""
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int):
        """The device's default ``torch.Generator``."""
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # -- streams, events, profiler ranges -------------------------------------------

    @property
    def Stream(self):  # noqa: N802 - DeepSpeed's accelerator API
        """``torch.cuda.Stream``; None on CPU, which has no streams."""
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self):  # noqa: N802 - DeepSpeed's accelerator API
        """``torch.cuda.Event``; None on CPU."""
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream):
        """A context that makes ``stream`` current (a no-op context on CPU)."""
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None):
        """The current CUDA stream; None on CPU."""
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None):
        """The default CUDA stream; None on CPU."""
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def side_stream(self):
        """A context that runs work on a secondary stream where the device has one."""
        return self.stream(torch.cuda.Stream()) if self._cuda else contextlib.nullcontext()

    def range_push(self, msg: str, domain=None, category=None):
        """Open a named NVTX range for profilers (no-op on CPU); ``domain``/``category`` unused."""
        del domain, category
        return torch.cuda.nvtx.range_push(msg) if self._cuda else None

    def range_pop(self, domain=None):
        """Close the innermost range opened by :meth:`range_push`."""
        del domain
        return torch.cuda.nvtx.range_pop() if self._cuda else None

    def lazy_call(self, callback):
        """Run ``callback`` once the device is initialised (at once on CPU)."""
        return torch.cuda._lazy_call(callback) if self._cuda else callback()


def get_accelerator() -> Accelerator:
    """Detect the accelerator: CUDA when present (override with SHARDWISE_ACCELERATOR=cpu)."""
    forced = os.environ.get("SHARDWISE_ACCELERATOR", "").strip().lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"SHARDWISE_ACCELERATOR must be 'cpu' or 'cuda', got {forced!r}; unset it to auto-detect")
    use_cuda = forced == "cuda" or (forced == "" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("SHARDWISE_ACCELERATOR=cuda but torch.cuda.is_available() is False")
    return Accelerator("cuda", "nccl") if use_cuda else Accelerator("cpu", "gloo")
