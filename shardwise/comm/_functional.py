"""DeepSpeed's functional ``deepspeed.comm`` API, forwarded to torch.distributed.

Scripts written for DeepSpeed do ``import deepspeed.comm as dist`` and call
``dist.all_reduce(t, op=dist.ReduceOp.SUM)``, ``dist.get_rank()`` and so on. Each function
here keeps DeepSpeed's name, positional arguments, defaults and return value (a torch
``Work`` when ``async_op=True``, else what torch returns) and forwards to the matching
torch.distributed call on the default group unless ``group`` is given.

DeepSpeed's profiling keywords (``prof``, ``log_name``, ``debug``) are accepted
keyword-only: with the comms logger enabled, a call is timed under ``log_name`` when
``prof=True``, under ``prof_all``, or when ``log_name`` is in ``prof_ops`` (see [Note: the
comms logger] in ``_logger.py``); the ``debug`` argument itself is ignored, as in
DeepSpeed, where the logger's own ``debug`` setting decides.
The library's own code uses :class:`shardwise.comm.Communicator`; this module is the
veneer for user scripts, and its synchronous collectives wait through one (see [Note:
deadlines in the functional API]).

[Note: deadlines in the functional API]
A synchronous call (``async_op=False``, and the calls that have no ``async_op``) starts
torch's collective with ``async_op=True`` and waits for it through a Communicator of its
group (one per group, built on first use), so it gets the library's deadline and
diagnosis: a collective that does not complete in time raises ``CollectiveError`` naming
it (``all_reduce #3 (16 x float32)``, with ``log_name`` as the tag when it is not the
default), and the rank then exits at once (see [Note: exit after a failure] in
``_exit.py``). The deadline is the group's: see [Note: the deadline of a process group] in
``_deadline.py`` (the engine's ``comm.timeout_s``, else the timeout the group was created
with). On gloo the wait stays on the calling thread, since gloo's works honour
``wait(timeout)``, except for the reduce-scatters, which go through the helper thread of
[Note: deadlines on every collective]; so a small ``all_reduce`` costs a few
microseconds more than torch's own. The same torch collective is issued either way, so
ranks that mix synchronous and asynchronous calls still match. An asynchronous call
returns torch's ``Work`` as DeepSpeed's does; waiting on it is the caller's, bounded by
the group's own timeout.

[Note: initialised means torch.distributed is initialised]
DeepSpeed tracks its own backend object and asserts it exists in get_rank, get_world_size,
get_local_rank, new_group and a few more; before ``init_distributed`` those raise
AssertionError. Here the state is torch's: after ``torch.distributed.init_process_group``
(or ``shardwise.init_distributed``) everything works, before it the same functions raise
AssertionError as DeepSpeed's do, and the other collectives raise torch's ValueError.
"""

from __future__ import annotations

import logging
import os
import pickle
import weakref
from enum import Enum

import torch
import torch.distributed as dist

from shardwise.accelerator import get_accelerator
from shardwise.comm._collectives import Communicator, Handle
from shardwise.comm._deadline import group_timeout
from shardwise.comm._logger import (
    OpTimer,
    comms_logger,
    configure,
    get_comm_operation_count,
    get_logged_comm_ops,
    has_comm_data,
    reset_log,
)

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


def _require_init(what: str) -> None:
    # See [Note: initialised means torch.distributed is initialised]. DeepSpeed raises
    # AssertionError here; scripts that probe with try/except expect that type.
    if not dist.is_initialized():
        raise AssertionError(
            f"shardwise.comm.{what}() needs an initialised process group; call "
            "deepspeed.init_distributed() (shardwise.init_distributed()) first"
        )


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


# -- waits with the group's deadline (see [Note: deadlines in the functional API]) ---------

_communicators: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""ProcessGroup -> (the Communicator this module waits through, whether the group is gloo)."""
_IGNORES_WAIT_TIMEOUT = frozenset({"reduce_scatter", "reduce_scatter_tensor"})
"""The collectives whose gloo work ignores ``wait(timeout)`` (see [Note: deadlines on
every collective] in ``_deadline.py``); the others are waited for without the helper."""
_NO_PAYLOAD = torch.empty(0)


def _group_entry(group) -> tuple[Communicator, bool]:
    """The Communicator for ``group`` (None: the default group), with the group's current
    deadline, and whether the group is gloo."""
    pg = dist.group.WORLD if group is None else group
    if pg is None:  # as torch's collectives do before init_process_group
        raise ValueError(
            "shardwise.comm needs an initialised process group; call "
            "deepspeed.init_distributed() (shardwise.init_distributed()) first"
        )
    entry = _communicators.get(pg)
    if entry is None:
        name = "world" if group is None else f"ranks {dist.get_process_group_ranks(pg)}"
        comm = Communicator(group, timeout_s=_own_timeout_s(pg), name=name)
        entry = _communicators[pg] = (comm, dist.get_backend(group) == "gloo")
    entry[0].timeout = group_timeout(pg) or entry[0].timeout
    return entry


def _communicator(group) -> Communicator:
    return _group_entry(group)[0]


def _own_timeout_s(pg) -> float:
    """The timeout ``pg`` was created with (torch's default if its backend hides it)."""
    try:
        return pg._get_backend(pg._device_types[0]).options._timeout.total_seconds()
    except (AttributeError, IndexError, RuntimeError):
        return dist.default_pg_timeout.total_seconds()


def _wait(work, op: str, tensor, group, log_name: str, timer: OpTimer | None = None) -> None:
    """Wait for ``work`` (None: this rank is not in ``group``) with the group's deadline,
    then stop ``timer``."""
    if work is None:
        return None
    comm, gloo = _group_entry(group)
    record = comm._count(op, tensor, "" if log_name == op else log_name, timer)
    Handle(comm, work, record, honours_timeout=gloo and op not in _IGNORES_WAIT_TIMEOUT).wait()
    return None


def _timer(op: str, log_name: str, prof: bool, payload, group) -> OpTimer | None:
    """Start timing a call about to be issued, if the comms logger selects it; called only
    when the logger is enabled. ``payload``: the input tensor, a list of them, or None."""
    if _not_member(group):
        return None
    tensors = [] if payload is None else payload if isinstance(payload, (list, tuple)) else [payload]
    size = sum(t.numel() * t.element_size() for t in tensors)
    device = tensors[0].device if tensors else _communicator(group)._device()
    return comms_logger.start(op, log_name, size, dist.get_world_size(group), device, prof=prof)


def _done(work, async_op: bool, op: str, tensor, group, log_name: str, timer: OpTimer | None):
    """What a collective returns: torch's ``Work`` when ``async_op`` (waited for first when
    timed, as DeepSpeed synchronizes timed calls), else None once it has completed."""
    if async_op and timer is None:
        return work
    _wait(work, op, tensor, group, log_name, timer)
    return work if async_op else None


def _not_member(group) -> bool:
    return group is not None and group == dist.GroupMember.NON_GROUP_MEMBER


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

    return init_device_mesh(get_accelerator().device_type, tuple(mesh_shape), mesh_dim_names=mesh_dim_names)


def destroy_process_group(group=None) -> None:
    """Destroy ``group``, or the default group and all others when None."""
    if group is None:
        _communicators.clear()
    else:
        _communicators.pop(group, None)
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

    def wait_with_deadline(self, op: str, tensors, group, log_name: str) -> None:
        for work, tensor in zip(self._works, tensors):
            _wait(work, op, tensor, group, log_name)


# -- collectives ------------------------------------------------------------------------


def barrier(group=None, async_op=False, device_ids=None, *, prof=False, log_name="barrier", debug=None):
    """Block until every rank of ``group`` arrives.

    ``device_ids`` is accepted and, as in DeepSpeed, not forwarded (torch uses it only to
    pick an NCCL device, which ``set_device`` already did).
    """
    del debug, device_ids
    timer = _timer("barrier", log_name, prof, None, group) if comms_logger.enabled else None
    work = dist.barrier(group=group, async_op=True)
    return _done(work, async_op, "barrier", _NO_PAYLOAD, group, log_name, timer)


def monitored_barrier(
    group=None, timeout=None, wait_all_ranks=False, *, prof=False, log_name="monitored_barrier", debug=None
):
    """A gloo barrier that names the ranks which did not arrive within ``timeout``."""
    del debug
    timer = _timer("monitored_barrier", log_name, prof, None, group) if comms_logger.enabled else None
    result = dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
    if timer is not None:
        timer.stop()
    return result


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, prof=False, log_name="all_reduce", debug=None):
    """Reduce ``tensor`` in place across ``group``; every rank gets the result."""
    del debug
    timer = _timer("all_reduce", log_name, prof, tensor, group) if comms_logger.enabled else None
    work = dist.all_reduce(tensor, op=_torch_op(op), group=group, async_op=True)
    return _done(work, async_op, "all_reduce", tensor, group, log_name, timer)


def inference_all_reduce(
    tensor, op=ReduceOp.SUM, group=None, async_op=False, *, prof=False, log_name="all_reduce", debug=None
):
    """A blocking all-reduce in place; with one rank it returns ``tensor`` untouched.

    ``async_op`` is accepted and ignored, as in DeepSpeed: the reduction always completes
    before the call returns.
    """
    del debug, async_op
    if dist.get_world_size(group=group) <= 1:
        return tensor
    timer = _timer("inference_all_reduce", log_name, prof, tensor, group) if comms_logger.enabled else None
    work = dist.all_reduce(tensor, op=_torch_op(op), group=group, async_op=True)
    return _wait(work, "all_reduce", tensor, group, log_name, timer)


def all_reduce_coalesced(
    tensors, op=ReduceOp.SUM, group=None, async_op=False, *, prof=False, log_name="all_reduce", debug=None
):
    """All-reduce each tensor of ``tensors`` in place; with ``async_op`` one handle waits on all.

    torch's ``all_reduce_coalesced`` is deprecated, so this issues one all-reduce per tensor.
    """
    del debug
    timer = _timer("all_reduce_coalesced", log_name, prof, list(tensors), group) if comms_logger.enabled else None
    handle = _WorkList([dist.all_reduce(t, op=_torch_op(op), group=group, async_op=True) for t in tensors])
    if async_op and timer is None:
        return handle
    handle.wait_with_deadline("all_reduce", tensors, group, log_name)
    if timer is not None:
        timer.stop()
    return handle if async_op else None


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, *, prof=False, log_name="reduce", debug=None):
    """Reduce ``tensor`` onto global rank ``dst`` (other ranks' tensors are unspecified after)."""
    del debug
    timer = _timer("reduce", log_name, prof, tensor, group) if comms_logger.enabled else None
    work = dist.reduce(tensor, dst=dst, op=_torch_op(op), group=group, async_op=True)
    return _done(work, async_op, "reduce", tensor, group, log_name, timer)


def broadcast(tensor, src, group=None, async_op=False, *, prof=False, log_name="broadcast", debug=None):
    """Copy global rank ``src``'s ``tensor`` into every rank's ``tensor``."""
    del debug
    timer = _timer("broadcast", log_name, prof, tensor, group) if comms_logger.enabled else None
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    return _done(work, async_op, "broadcast", tensor, group, log_name, timer)


def broadcast_object_list(object_list, src, group=None, device=None):
    """Replace ``object_list``'s items on every rank with rank ``src``'s (pickled) items.

    Two broadcasts (sizes, then the pickles, on ``device`` or this backend's device), each
    with the group's deadline. Pickle travels between this job's own ranks only."""
    if _not_member(group):
        return None
    comm = _communicator(group)
    group_src = src if group is None else dist.get_group_rank(group, src)
    device = torch.device(device) if device is not None else comm._device()
    pickles = [pickle.dumps(obj) for obj in object_list] if comm.rank == group_src else None
    sizes = torch.tensor([len(p) for p in pickles] if pickles else [0] * len(object_list), device=device)
    comm.broadcast(sizes, src=group_src, tag="broadcast_object_list sizes").wait()
    if pickles:
        payload = torch.frombuffer(bytearray(b"".join(pickles)), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(sizes.sum()), dtype=torch.uint8, device=device)
    comm.broadcast(payload, src=group_src, tag="broadcast_object_list").wait()
    if pickles is None:
        data, start = payload.cpu().numpy().tobytes(), 0
        for i, size in enumerate(sizes.tolist()):
            object_list[i] = pickle.loads(data[start : start + size])
            start += size
    return None


def all_gather(tensor_list, tensor, group=None, async_op=False, *, prof=False, log_name="all_gather", debug=None):
    """Fill ``tensor_list[r]`` with rank r's ``tensor`` on every rank."""
    del debug
    timer = _timer("all_gather", log_name, prof, tensor, group) if comms_logger.enabled else None
    work = dist.all_gather(tensor_list, tensor, group=group, async_op=True)
    return _done(work, async_op, "all_gather", tensor, group, log_name, timer)


def all_gather_object(object_list, obj, group=None, *, prof=False, log_name="all_gather_object", debug=None):
    """Fill ``object_list[r]`` with rank r's picklable ``obj`` on every rank (with the
    group's deadline: see :meth:`Communicator.all_gather_object`). Not timed by the comms
    logger (its two all-gathers move pickles, not a message of a fixed size)."""
    del debug, prof
    if _not_member(group):
        return None
    tag = "" if log_name == "all_gather_object" else log_name
    for rank, value in enumerate(_communicator(group).all_gather_object(obj, tag=tag)):
        object_list[rank] = value
    return None


def all_gather_into_tensor(
    output_tensor, tensor, group=None, async_op=False, *, prof=False, log_name="all_gather_into_tensor", debug=None
):
    """Concatenate every rank's ``tensor`` along dim 0 into ``output_tensor``, in rank order."""
    del debug
    timer = _timer("all_gather_into_tensor", log_name, prof, tensor, group) if comms_logger.enabled else None
    work = dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=True)
    return _done(work, async_op, "all_gather_into_tensor", output_tensor, group, log_name, timer)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    """DeepSpeed's name for :func:`all_gather_into_tensor`."""
    _require_init("allgather_fn")
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op, debug=debug)


def all_gather_coalesced(output_tensors, input_tensors, group=None, async_op=False):
    """:func:`all_gather_into_tensor` for each (output, input) pair; one handle waits on all."""
    if len(output_tensors) != len(input_tensors):
        raise ValueError(
            f"all_gather_coalesced needs one output per input, got {len(output_tensors)} "
            f"outputs and {len(input_tensors)} inputs"
        )
    _require_init("all_gather_coalesced")
    works = [
        dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
        for out, inp in zip(output_tensors, input_tensors)
    ]
    handle = _WorkList(works)
    if async_op:
        return handle
    handle.wait_with_deadline("all_gather_into_tensor", output_tensors, group, "all_gather_into_tensor")
    return None


def reduce_scatter(
    output,
    input_list,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    *,
    prof=False,
    log_name="reduce_scatter",
    debug=None,
):
    """Reduce ``input_list[r]`` across ranks into rank r's ``output``."""
    del debug
    timer = _timer("reduce_scatter", log_name, prof, list(input_list), group) if comms_logger.enabled else None
    work = dist.reduce_scatter(output, input_list, op=_torch_op(op), group=group, async_op=True)
    return _done(work, async_op, "reduce_scatter", output, group, log_name, timer)


def reduce_scatter_tensor(
    output_tensor,
    tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    *,
    prof=False,
    log_name="reduce_scatter_tensor",
    debug=None,
):
    """Reduce ``tensor`` across ranks; rank r keeps the r-th dim-0 chunk in ``output_tensor``."""
    del debug
    timer = _timer("reduce_scatter_tensor", log_name, prof, tensor, group) if comms_logger.enabled else None
    work = dist.reduce_scatter_tensor(output_tensor, tensor, op=_torch_op(op), group=group, async_op=True)
    return _done(work, async_op, "reduce_scatter_tensor", tensor, group, log_name, timer)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, *, prof=False, debug=None):
    """DeepSpeed's name for :func:`reduce_scatter_tensor`."""
    _require_init("reduce_scatter_fn")
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op, prof=prof, debug=debug)


def all_to_all_single(
    output,
    tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    async_op=False,
    *,
    prof=False,
    log_name="all_to_all_single",
    debug=None,
):
    """Split ``tensor`` along dim 0, send split r to rank r, concatenate what arrives in ``output``."""
    del debug
    timer = _timer("all_to_all_single", log_name, prof, tensor, group) if comms_logger.enabled else None
    work = dist.all_to_all_single(
        output,
        tensor,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=group,
        async_op=True,
    )
    return _done(work, async_op, "all_to_all_single", tensor, group, log_name, timer)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """Send ``input_tensor_list[r]`` to rank r; receive rank r's into ``output_tensor_list[r]``.

    The gloo backend has no all_to_all; torch raises there.
    """
    timer = _timer("all_to_all", "all_to_all", False, list(input_tensor_list), group) if comms_logger.enabled else None
    work = dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=True)
    first = input_tensor_list[0] if input_tensor_list else _NO_PAYLOAD
    return _done(work, async_op, "all_to_all", first, group, "all_to_all", timer)


def send(tensor, dst, group=None, tag=0, *, prof=False, log_name="send", debug=None):
    """Send ``tensor`` to global rank ``dst``; blocks until it is sent."""
    del debug
    if dst == dist.get_rank():
        raise ValueError(f"send to rank {dst}, the rank of this process: send to another rank")
    timer = _timer("send", log_name, prof, tensor, group) if comms_logger.enabled else None
    return _wait(dist.isend(tensor, dst=dst, group=group, tag=tag), "send", tensor, group, log_name, timer)


def recv(tensor, src=None, group=None, tag=0, *, prof=False, log_name="recv", debug=None):
    """Receive into ``tensor`` from global rank ``src`` (any rank when None); returns the
    sender, or -1 if this rank is not in ``group``."""
    del debug
    if src == dist.get_rank():
        raise ValueError(f"recv from rank {src}, the rank of this process: receive from another rank")
    timer = _timer("recv", log_name, prof, tensor, group) if comms_logger.enabled else None
    work = dist.irecv(tensor, src=src, group=group, tag=tag)
    if work is None:
        return -1
    _wait(work, "recv", tensor, group, log_name, timer)
    if src is not None:
        return src
    return work._source_rank() if group is None else dist.get_global_rank(group, work._source_rank())


def isend(tensor, dst, group=None, tag=0, *, prof=False, log_name="isend", debug=None):
    """Send ``tensor`` to ``dst`` and return None once it is sent: DeepSpeed's ``isend``
    is a blocking send despite its name, and scripts written for it may reuse the tensor
    right after the call. For an asynchronous send use ``torch.distributed.isend``."""
    return send(tensor, dst, group, tag, prof=prof, log_name=log_name, debug=debug)


def irecv(tensor, src=None, group=None, tag=0, *, prof=False, log_name="irecv", debug=None):
    """Receive into ``tensor`` and return the sender once it has arrived (DeepSpeed's
    ``irecv`` is a blocking receive; see ``isend``)."""
    return recv(tensor, src, group, tag, prof=prof, log_name=log_name, debug=debug)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, *, prof=False, log_name="gather", debug=None):
    """Collect every rank's ``tensor`` into ``gather_list`` on rank ``dst`` (None elsewhere)."""
    del debug
    timer = _timer("gather", log_name, prof, tensor, group) if comms_logger.enabled else None
    work = dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=True)
    return _done(work, async_op, "gather", tensor, group, log_name, timer)


def scatter(
    tensor, scatter_list=None, src=0, group=None, async_op=False, *, prof=False, log_name="scatter", debug=None
):
    """Copy ``scatter_list[r]`` on rank ``src`` into rank r's ``tensor``."""
    del debug
    timer = _timer("scatter", log_name, prof, tensor, group) if comms_logger.enabled else None
    work = dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=True)
    return _done(work, async_op, "scatter", tensor, group, log_name, timer)


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


# -- DeepSpeed's comms logger (the rest of its API lives in _logger.py) ---------------------


def log_summary(show_straggler=False, return_dict=False):
    """Print the comms logger's table on rank 0 (see [Note: the comms logger] in ``_logger.py``).

    The table has a header row (``Comm. Op``, ``Message Size``, ``Count``, ``Total
    Latency(ms)``, ``Avg Latency(ms)``, ``tput_avg (Gbps)``, ``busbw_avg (Gbps)``), then per
    log name a line with the name and one row per message size; averages drop the
    fastest and slowest 10% of the calls. Every rank of the default group must call it
    when ``show_straggler`` is true; otherwise each rank reads its own records (the
    numbers printed are rank 0's).

    Args:
        show_straggler: also print, per log name and size, the latency of the fastest
            rank (min over ranks, call by call) and how much longer this rank took: one
            all-gather and one all-reduce over the default group, not themselves logged.
        return_dict: also return ``{"summary": ..., "straggler_analysis": ... or None,
            "metadata": {"world_size", "rank", "timestamp"}}`` (DeepSpeed's layout).
    """
    comm = _communicator(None) if show_straggler and dist.is_initialized() else None
    rank = dist.get_rank() if dist.is_initialized() else 0
    return comms_logger.log_all(print_log=rank == 0, show_straggler=show_straggler, return_dict=return_dict, comm=comm)


__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "configure",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_backend",
    "get_comm_operation_count",
    "get_global_rank",
    "get_local_rank",
    "get_local_rank_from_launcher",
    "get_logged_comm_ops",
    "get_rank",
    "get_world_group",
    "get_world_rank_from_launcher",
    "get_world_size",
    "get_world_size_from_launcher",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_comm_data",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "initialize_mesh_device",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "reset_log",
    "scatter",
    "send",
]
