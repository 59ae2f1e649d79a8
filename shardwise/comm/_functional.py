"""DeepSpeed's functional ``deepspeed.comm`` API, forwarded to torch.distributed.

Scripts written for DeepSpeed do ``import deepspeed.comm as dist`` and call
``dist.all_reduce(t, op=dist.ReduceOp.SUM)``, ``dist.get_rank()`` and so on. Each function
here keeps DeepSpeed's name, positional arguments, defaults and return value (a torch
``Work`` when ``async_op=True``, else what torch returns) and forwards to the matching
torch.distributed call on the default group unless ``group`` is given.

DeepSpeed's profiling keywords (``prof``, ``log_name``, ``debug``) are accepted
keyword-only; this module does not time collectives, so ``prof=True`` logs a warning once.
The library's own code uses :class:`shardwise.comm.Communicator`, which counts collectives
and names the one a rank hangs in; this module is the veneer for user scripts.

[Note: initialised means torch.distributed is initialised]
DeepSpeed tracks its own backend object and asserts it exists in get_rank, get_world_size,
get_local_rank, new_group and a few more; before ``init_distributed`` those raise
AssertionError. Here the state is torch's: after ``torch.distributed.init_process_group``
(or ``shardwise.init_distributed``) everything works, before it the same functions raise
AssertionError as DeepSpeed's do, and the other collectives raise torch's ValueError.
"""

from __future__ import annotations

import functools
import logging
import os
from enum import Enum

import torch.distributed as dist

from shardwise.accelerator import get_accelerator

logger = logging.getLogger(__name__)


class ReduceOp(Enum):
    """DeepSpeed's reduction operators; torch's ``dist.ReduceOp`` values are accepted too."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


def _torch_op(op):
    if not isinstance(op, ReduceOp):
        return op
    if op is ReduceOp.UNUSED:
        raise ValueError("op=ReduceOp.UNUSED is a placeholder, not a reduction; use SUM, AVG, MAX, ...")
    return getattr(dist.ReduceOp, op.name)


@functools.lru_cache(maxsize=None)
def _warn_unprofiled() -> None:
    logger.warning("shardwise.comm does not time collectives; prof=True is ignored")


def _unprofiled(prof: bool) -> None:
    if prof:
        _warn_unprofiled()


def _require_init(what: str) -> None:
    # See [Note: initialised means torch.distributed is initialised]. DeepSpeed raises
    # AssertionError here; scripts that probe with try/except expect that type.
    if not dist.is_initialized():
        raise AssertionError(f"shardwise.comm.{what}() needs an initialised process group; call "
                             "deepspeed.init_distributed() (shardwise.init_distributed()) first")


def _launcher_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def get_local_rank_from_launcher() -> int:
    """LOCAL_RANK (or Open MPI's local rank) from the environment; 0 when unset."""
    return _launcher_int(("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), 0)


def get_world_rank_from_launcher() -> int:
    """RANK (or Open MPI's world rank) from the environment; 0 when unset."""
    return _launcher_int(("RANK", "OMPI_COMM_WORLD_RANK"), 0)


def get_world_size_from_launcher() -> int:
    """WORLD_SIZE (or Open MPI's world size) from the environment; 1 when unset."""
    return _launcher_int(("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"), 1)


# -- process group state ----------------------------------------------------------------

def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_initialized()


def is_available() -> bool:
    """Whether the communication package can be used (always True, as in DeepSpeed)."""
    return True


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (default group when None); -1 if not a member."""
    _require_init("get_rank")
    return dist.get_rank(group=group)


def get_world_size(group=None) -> int:
    """The number of ranks in ``group`` (default group when None); -1 if not a member."""
    _require_init("get_world_size")
    return dist.get_world_size(group=group)


def get_local_rank() -> int:
    """This process's rank on its node, as the launcher announced it (LOCAL_RANK)."""
    _require_init("get_local_rank")
    return get_local_rank_from_launcher()


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The global rank of rank ``group_rank`` of ``group`` (None: the default group)."""
    _require_init("get_global_rank")
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)


def get_all_ranks_from_group(group=None) -> list[int]:
    """The global ranks that make up ``group`` (None: the default group), in group order."""
    _require_init("get_all_ranks_from_group")
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def get_world_group():
    """The default (world) process group."""
    _require_init("get_world_group")
    return dist.group.WORLD


def get_backend(group=None) -> str:
    """The backend name of ``group`` (``"gloo"``, ``"nccl"``, ...)."""
    return dist.get_backend(group=group)


def new_group(ranks):
    """A new process group of the global ``ranks``; every rank must call it."""
    _require_init("new_group")
    return dist.new_group(ranks)


def initialize_mesh_device(mesh_shape, mesh_dim_names):
    """A torch ``DeviceMesh`` of ``mesh_shape`` over this accelerator's device type."""
    _require_init("initialize_mesh_device")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(get_accelerator().device_type, tuple(mesh_shape),
                            mesh_dim_names=mesh_dim_names)


def destroy_process_group(group=None) -> None:
    """Destroy ``group``, or the default group and all others when None."""
    return dist.destroy_process_group(group=group)


class _WorkList:
    """Waits on several async collectives as one handle."""

    def __init__(self, works):
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


# -- collectives ------------------------------------------------------------------------

def barrier(group=None, async_op=False, device_ids=None, *, prof=False, log_name="barrier", debug=None):
    """Block until every rank of ``group`` arrives.

    ``device_ids`` is accepted and, as in DeepSpeed, not forwarded (torch uses it only to
    pick an NCCL device, which ``set_device`` already did).
    """
    del log_name, debug, device_ids
    _unprofiled(prof)
    return dist.barrier(group=group, async_op=async_op)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False, *, prof=False,
                      log_name="monitored_barrier", debug=None):
    """A gloo barrier that names the ranks which did not arrive within ``timeout``."""
    del log_name, debug
    _unprofiled(prof)
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, prof=False,
               log_name="all_reduce", debug=None):
    """Reduce ``tensor`` in place across ``group``; every rank gets the result."""
    del log_name, debug
    _unprofiled(prof)
    return dist.all_reduce(tensor, op=_torch_op(op), group=group, async_op=async_op)


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, prof=False,
                         log_name="all_reduce", debug=None):
    """A blocking all-reduce in place; with one rank it returns ``tensor`` untouched.

    ``async_op`` is accepted and ignored, as in DeepSpeed: the reduction always completes
    before the call returns.
    """
    del log_name, debug, async_op
    _unprofiled(prof)
    if dist.get_world_size(group=group) <= 1:
        return tensor
    return dist.all_reduce(tensor, op=_torch_op(op), group=group)


def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False, *, prof=False,
                         log_name="all_reduce", debug=None):
    """All-reduce each tensor of ``tensors`` in place; with ``async_op`` one handle waits on all.

    torch's ``all_reduce_coalesced`` is deprecated, so this issues one all-reduce per tensor.
    """
    del log_name, debug
    _unprofiled(prof)
    handle = _WorkList([dist.all_reduce(t, op=_torch_op(op), group=group, async_op=True) for t in tensors])
    if async_op:
        return handle
    handle.wait()
    return None


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, *, prof=False, log_name="reduce",
           debug=None):
    """Reduce ``tensor`` onto global rank ``dst`` (other ranks' tensors are unspecified after)."""
    del log_name, debug
    _unprofiled(prof)
    return dist.reduce(tensor, dst=dst, op=_torch_op(op), group=group, async_op=async_op)


def broadcast(tensor, src, group=None, async_op=False, *, prof=False, log_name="broadcast", debug=None):
    """Copy global rank ``src``'s ``tensor`` into every rank's ``tensor``."""
    del log_name, debug
    _unprofiled(prof)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def broadcast_object_list(object_list, src, group=None, device=None):
    """Replace ``object_list``'s items on every rank with rank ``src``'s (pickled) items."""
    return dist.broadcast_object_list(object_list, src=src, group=group, device=device)


def all_gather(tensor_list, tensor, group=None, async_op=False, *, prof=False, log_name="all_gather",
               debug=None):
    """Fill ``tensor_list[r]`` with rank r's ``tensor`` on every rank."""
    del log_name, debug
    _unprofiled(prof)
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list, obj, group=None, *, prof=False, log_name="all_gather_object",
                      debug=None):
    """Fill ``object_list[r]`` with rank r's picklable ``obj`` on every rank."""
    del log_name, debug
    _unprofiled(prof)
    return dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, *, prof=False,
                           log_name="all_gather_into_tensor", debug=None):
    """Concatenate every rank's ``tensor`` along dim 0 into ``output_tensor``, in rank order."""
    del log_name, debug
    _unprofiled(prof)
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    """DeepSpeed's name for :func:`all_gather_into_tensor`."""
    _require_init("allgather_fn")
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op, debug=debug)


def all_gather_coalesced(output_tensors, input_tensors, group=None, async_op=False):
    """:func:`all_gather_into_tensor` for each (output, input) pair; one handle waits on all."""
    if len(output_tensors) != len(input_tensors):
        raise ValueError(f"all_gather_coalesced needs one output per input, got {len(output_tensors)} "
                         f"outputs and {len(input_tensors)} inputs")
    _require_init("all_gather_coalesced")
    works = [dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
             for out, inp in zip(output_tensors, input_tensors)]
    handle = _WorkList(works)
    if async_op:
        return handle
    handle.wait()
    return None


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, *, prof=False,
                   log_name="reduce_scatter", debug=None):
    """Reduce ``input_list[r]`` across ranks into rank r's ``output``."""
    del log_name, debug
    _unprofiled(prof)
    return dist.reduce_scatter(output, input_list, op=_torch_op(op), group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, *,
                          prof=False, log_name="reduce_scatter_tensor", debug=None):
    """Reduce ``tensor`` across ranks; rank r keeps the r-th dim-0 chunk in ``output_tensor``."""
    del log_name, debug
    _unprofiled(prof)
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=_torch_op(op), group=group,
                                      async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, *,
                      prof=False, debug=None):
    """DeepSpeed's name for :func:`reduce_scatter_tensor`."""
    _require_init("reduce_scatter_fn")
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op, prof=prof,
                                 debug=debug)


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False, *, prof=False, log_name="all_to_all_single", debug=None):
    """Split ``tensor`` along dim 0, send split r to rank r, concatenate what arrives in ``output``."""
    del log_name, debug
    _unprofiled(prof)
    return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """Send ``input_tensor_list[r]`` to rank r; receive rank r's into ``output_tensor_list[r]``.

    The gloo backend has no all_to_all; torch raises there.
    """
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def send(tensor, dst, group=None, tag=0, *, prof=False, log_name="send", debug=None):
    """Send ``tensor`` to global rank ``dst``; blocks until it is sent."""
    del log_name, debug
    _unprofiled(prof)
    return dist.send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor, src=None, group=None, tag=0, *, prof=False, log_name="recv", debug=None):
    """Receive into ``tensor`` from global rank ``src`` (any rank when None); returns the sender."""
    del log_name, debug
    _unprofiled(prof)
    return dist.recv(tensor, src=src, group=group, tag=tag)


def isend(tensor, dst, group=None, tag=0, *, prof=False, log_name="isend", debug=None):
    """Send ``tensor`` to ``dst`` and return None once it is sent: DeepSpeed's ``isend``
    is a blocking send despite its name, and scripts written for it may reuse the tensor
    right after the call. For an asynchronous send use ``torch.distributed.isend``."""
    return send(tensor, dst, group, tag, prof=prof, log_name=log_name, debug=debug)


def irecv(tensor, src=None, group=None, tag=0, *, prof=False, log_name="irecv", debug=None):
    """Receive into ``tensor`` and return the sender once it has arrived (DeepSpeed's
    ``irecv`` is a blocking receive; see ``isend``)."""
    return recv(tensor, src, group, tag, prof=prof, log_name=log_name, debug=debug)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, *, prof=False, log_name="gather",
           debug=None):
    """Collect every rank's ``tensor`` into ``gather_list`` on rank ``dst`` (None elsewhere)."""
    del log_name, debug
    _unprofiled(prof)
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, *, prof=False,
            log_name="scatter", debug=None):
    """Copy ``scatter_list[r]`` on rank ``src`` into rank r's ``tensor``."""
    del log_name, debug
    _unprofiled(prof)
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


# -- capability probes (DeepSpeed's code paths for old torch versions) -------------------

def has_all_gather_into_tensor() -> bool:
    """Whether :func:`all_gather_into_tensor` is native (always, on the torch we require)."""
    _require_init("has_all_gather_into_tensor")
    return True


def has_reduce_scatter_tensor() -> bool:
    """Whether :func:`reduce_scatter_tensor` is native (always, on the torch we require)."""
    _require_init("has_reduce_scatter_tensor")
    return True


def has_all_reduce_coalesced() -> bool:
    """Whether :func:`all_reduce_coalesced` is available (always)."""
    _require_init("has_all_reduce_coalesced")
    return True


def has_coalescing_manager() -> bool:
    """Whether torch's private coalescing manager is used (never: this module uses public APIs)."""
    _require_init("has_coalescing_manager")
    return False


# -- DeepSpeed's comms logger: not collected here ------------------------------------------

def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None):
    """Accepts DeepSpeed's comms-logger settings; warns when ``enabled`` asks for logging."""
    del deepspeed_config, prof_all, prof_ops, verbose, debug
    if enabled:
        logger.warning("shardwise.comm does not log collectives; comms logger enabled=True is ignored")


def log_summary(show_straggler=False, return_dict=False):
    """No collective statistics are collected: returns ``{}`` when ``return_dict``, else None."""
    del show_straggler
    return {} if return_dict else None


def reset_log() -> None:
    """Nothing to clear: no collective statistics are collected."""


def has_comm_data() -> bool:
    """Always False: no collective statistics are collected."""
    return False


def get_comm_operation_count() -> int:
    """Always 0: no collective statistics are collected."""
    return 0


def get_logged_comm_ops() -> list[str]:
    """Always empty: no collective statistics are collected."""
    return []


__all__ = [
    "ReduceOp", "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object",
    "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single", "allgather_fn", "barrier",
    "broadcast", "broadcast_object_list", "configure", "destroy_process_group", "gather",
    "get_all_ranks_from_group", "get_backend", "get_comm_operation_count", "get_global_rank",
    "get_local_rank", "get_local_rank_from_launcher", "get_logged_comm_ops", "get_rank",
    "get_world_group", "get_world_rank_from_launcher", "get_world_size", "get_world_size_from_launcher",
    "has_all_gather_into_tensor", "has_all_reduce_coalesced", "has_coalescing_manager", "has_comm_data",
    "has_reduce_scatter_tensor", "inference_all_reduce", "initialize_mesh_device", "irecv",
    "is_available", "is_initialized", "isend", "log_summary", "monitored_barrier", "new_group", "recv",
    "reduce", "reduce_scatter", "reduce_scatter_fn", "reduce_scatter_tensor", "reset_log", "scatter",
    "send",
]
