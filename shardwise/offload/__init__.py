"""ZeRO-Offload and ZeRO-Infinity tiers: optimizer state in CPU memory or swap files.

``offload_optimizer.device = "cpu"`` needs no code of its own beyond placement: the ZeRO
strategies keep fp32 master shards, gradient shards and optimizer state on the CPU and
step them there with torch's fused CPU kernels; on a GPU the copies between device and
host overlap compute (:class:`HostCopies`, :func:`copy_from_host_`). ``"nvme"`` adds
:class:`OptimizerSwapper`, which keeps that state in checked swap files and in memory
only one sub-group at a time.
"""

from shardwise.offload._aio import SwapFileError, SwapIO, SwapRecord
from shardwise.offload._copies import HostCopies, PendingCopy, copy_from_host_, to_device
from shardwise.offload._nvme import SwapPathError, make_swap_dir, remove_swap_dir, reserve
from shardwise.offload._optimizer import OptimizerSwapper, build_optimizer_swapper, state_tensors_per_param

__all__ = [
    "HostCopies",
    "OptimizerSwapper",
    "PendingCopy",
    "SwapFileError",
    "SwapIO",
    "SwapPathError",
    "SwapRecord",
    "build_optimizer_swapper",
    "copy_from_host_",
    "make_swap_dir",
    "remove_swap_dir",
    "reserve",
    "state_tensors_per_param",
    "to_device",
]
