"""``engine.offload_states()`` / ``reload_states()``: move training state off the device
between phases (e.g. while the same GPU generates rollouts in RLHF), and back.

[Note: offloading by storage]
Model code, the optimizer and the ZeRO buckets hold views into a few flat storages, so
moving a tensor by rebinding it would leave stale views behind. Instead each storage's
bytes are copied into one host buffer and the storage is resized to zero bytes; reload
resizes it back and copies the bytes in. Every view (``.grad``, parameter, optimizer
state) stays valid and sees its old values after the reload. Storages already in host
memory when the engine computes on a GPU (offloaded optimizer state) are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

_ALL_KINDS = tuple(kind.value for kind in OffloadStateTypeEnum)


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    host: torch.Tensor


def _kinds(include) -> list[str]:
    if include is None:
        return list(_ALL_KINDS)
    kinds = [OffloadStateTypeEnum(k).value for k in include]
    return [k for k in _ALL_KINDS if k in kinds]


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StateOffloader:
    """Offloads and reloads an engine's state tensors (see [Note: offloading by storage])."""

    def __init__(self, strategy, compute_device: torch.device):
        self.strategy = strategy
        self.compute_device = compute_device
        self.moved: list[_Moved] = []

    def offload(
        self, *, include=None, device=OffloadDeviceEnum.cpu, pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        device = OffloadDeviceEnum(device)
        if device == OffloadDeviceEnum.nvme:
            raise ValueError("offload_states(device='nvme') is not supported; offload to 'cpu'")
        if device == OffloadDeviceEnum.none:
            return
        if getattr(self.strategy, "swapper", None) is not None:
            raise ValueError(
                "offload_states() cannot move state that nvme offload manages; it already lives in swap files"
            )
        seen = {m.storage.data_ptr() for m in self.moved}
        pin = pin_memory and self.compute_device.type == "cuda"
        for kind in _kinds(include):
            for tensor in self.strategy.views.state_tensors(kind):
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen or self._stays(storage):
                    continue
                seen.add(storage.data_ptr())
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(_byte_view(storage), non_blocking=non_blocking and pin)
                self.moved.append(_Moved(storage, host))
        if self.compute_device.type == "cuda":
            torch.cuda.synchronize()
        for moved in self.moved:
            moved.storage.resize_(0)

    def _stays(self, storage: torch.UntypedStorage) -> bool:
        """Host-resident storages of a GPU engine are already offloaded."""
        return self.compute_device.type != "cpu" and storage.device.type == "cpu"

    def reload(self, *, non_blocking: bool = False) -> None:
        for moved in self.moved:
            moved.storage.resize_(moved.host.numel())
            _byte_view(moved.storage).copy_(moved.host, non_blocking=non_blocking)
        if self.moved and self.compute_device.type == "cuda" and not non_blocking:
            torch.cuda.synchronize()
        self.moved = []

    @property
    def offloaded_bytes(self) -> int:
        return sum(m.host.numel() for m in self.moved)
