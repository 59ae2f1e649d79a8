"""Copies between a GPU and CPU memory that overlap the GPU's compute (offload).

[Note: host copies]
With offload on a GPU, gradient shards travel to CPU memory while backward goes on, and
updated parameters travel back while the CPU steps the next sub-group. A plain
``tensor.to("cpu")``, or a copy to the GPU from pageable memory, makes the Python thread
wait for all GPU work queued before it; done once per bucket it empties the GPU's queue
and the GPU idles while the CPU catches up. So:

- Device to host (:meth:`HostCopies.to_host`): a side stream first waits for the compute
  stream (where the data was produced), then copies into page-locked memory with
  ``non_blocking=True`` and records an event. The source is marked as in use by the side
  stream (``record_stream``) so the caching allocator does not hand its memory out again
  before the copy has read it. Nothing reads the destination before its event has passed:
  :meth:`PendingCopy.result` waits for it, :meth:`PendingCopy.done` asks without waiting.
- Host to device (:func:`copy_from_host_`): the values are first cast on the CPU into
  page-locked memory of the destination's dtype (half the bytes for bf16/fp16), then
  copied on the compute stream, where their consumers run, with ``non_blocking=True``.
  The host source is read before the call returns, so it may change right after; the
  page-locked staging block goes back to torch's pinned-memory cache, which hands it
  out again only after the copy's event has passed.

On the CPU there is nothing to move: ``to_host`` hands back its argument and
``copy_from_host_`` is a plain copy. This module is the only place that touches CUDA
streams and events for offload.
"""

from __future__ import annotations

import torch


class PendingCopy:
    """A device-to-host copy in flight; ``result()`` is the host tensor once it has landed."""

    def __init__(self, tensor: torch.Tensor, event=None):
        self._tensor = tensor
        self._event = event

    def done(self) -> bool:
        """Whether the bytes are on the host (never waits)."""
        return self._event is None or self._event.query()

    def result(self) -> torch.Tensor:
        """Wait for the copy, then return the host tensor."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._tensor


class HostCopies:
    """Device-to-host copies on a side stream of ``device`` (see [Note: host copies]).

    Args:
        device: the device the copied tensors live on; on the CPU nothing is copied.
    """

    def __init__(self, device: torch.device):
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def to_host(self, tensor: torch.Tensor) -> PendingCopy:
        """Start copying ``tensor`` into page-locked CPU memory once the work queued on the
        current stream (which produced it) is done; the caller may drop ``tensor``."""
        if self._stream is None:
            return PendingCopy(tensor)
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._stream):
            out.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        tensor.record_stream(self._stream)
        return PendingCopy(out, event)


def copy_from_host_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for a CPU ``src`` that does not stall the Python thread when
    ``dst`` is on a GPU (see [Note: host copies]); ``src`` may change once this returns."""
    if dst.device.type != "cuda" or src.device.type != "cpu":
        return dst.copy_(src)
    staging = torch.empty(src.shape, dtype=dst.dtype, pin_memory=True)
    staging.copy_(src)
    return dst.copy_(staging, non_blocking=True)


def to_device(src: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``src.to(device, dtype)`` through :func:`copy_from_host_` (``src`` itself when it is
    already there in that dtype)."""
    if src.device == device and src.dtype == dtype:
        return src
    return copy_from_host_(torch.empty(src.shape, dtype=dtype, device=device), src)
