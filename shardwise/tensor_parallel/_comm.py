"""The tensor-parallel group a layer talks to, from whatever the caller holds."""

from __future__ import annotations

import torch.distributed as dist

from shardwise.comm import Communicator

_COMMS: dict = {}
"""One Communicator per process group wrapped here, so the collectives of one group are
numbered and counted in one place. Groups live as long as the process, and so do these."""


def as_tensor_comm(group) -> Communicator:
    """The :class:`Communicator` of the tensor-parallel group that ``group`` names.

    Accepts, in this order: a ``Communicator`` (returned as is); an object with a
    ``tensor_comm`` attribute (a ``shardwise.parallel.ParallelGrid``); an mpu-like object
    with ``get_tensor_model_parallel_group()`` or else ``get_model_parallel_group()``
    (Megatron's ``parallel_state``, DeepSpeed's mpu); a torch ``ProcessGroup``. A process
    group is wrapped in ``Communicator(group, name="tensor-parallel", shared_memory=True)`` once; later calls
    with the same group return that Communicator.

    Raises:
        ValueError: ``group`` is None (there is no default tensor-parallel group).
        TypeError: ``group`` is none of the above.
    """
    if group is None:
        raise ValueError("pass group=: the tensor-parallel process group, a Communicator, or the grid")
    if isinstance(group, Communicator):
        return group
    if hasattr(group, "tensor_comm"):
        return group.tensor_comm
    for getter in ("get_tensor_model_parallel_group", "get_model_parallel_group"):
        if hasattr(group, getter):
            found = getattr(group, getter)()
            if found is None:
                raise ValueError(
                    f"{type(group).__name__}.{getter}() returned None: initialise "
                    "model parallelism first, or pass the group itself"
                )
            return as_tensor_comm(found)
    if isinstance(group, dist.ProcessGroup):
        if group not in _COMMS:
            _COMMS[group] = Communicator(group, name="tensor-parallel", shared_memory=True)
        return _COMMS[group]
    raise TypeError(
        f"group= must be the tensor-parallel process group, a Communicator, a grid "
        f"with tensor_comm or an mpu; got {type(group).__name__}"
    )
