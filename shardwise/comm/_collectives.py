"""Collectives with a deadline and a diagnosis.

Every collective shardwise issues goes through a :class:`Communicator`: it numbers the
collectives of its group, counts calls and bytes (tests assert communication behaviour
from these counts), and turns a collective that fails or exceeds the timeout into a
:class:`CollectiveError` that names this rank, the collective, its sequence number, its
size and its tag (the bucket or parameter involved).

[Note: hang diagnosis]
When a collective fails, the failing rank publishes what it was waiting in to the
process group's key-value store and then reads what its peers published within a short
grace period. Peers stuck in a different collective time out at about the same moment
and publish theirs; a peer that published nothing is dead or busy outside any
collective. The error lists all of it, so ranks that diverged are named instead of the
job hanging silently until a 30-minute default timeout.

[Note: stream-ordered waits]
A CPU (gloo) collective is done when its wait returns, so that wait blocks, with the
deadline above (enforced for every collective kind: see [Note: deadlines on every
collective] in ``_deadline.py``). An NCCL collective runs on a stream of its own;
waiting for it with a deadline would hold the Python thread until it has finished, so
the thread could queue no more compute meanwhile and the GPU would drain its queue at
every bucket and every stage-3 gather. On NCCL a wait therefore only makes the current
stream wait for the collective, as PyTorch's ``work.wait()`` does by default, and hands it to a hang watch
that diagnoses it as above if it is still running ``comm.timeout_s`` later (see [Note:
watching stream-ordered collectives] in ``_hang_watch.py``). ``TORCH_NCCL_BLOCKING_WAIT=1``
restores blocking waits, at the cost of that overlap, as it does in PyTorch.

[Note: gloo reduce-scatter and all-gather by all-reduce]
gloo's all-reduce is much faster than its reduce-scatter and all-gather on the same
buffer (27.4M fp32 elements on 2 ranks, torch 2.13: all-reduce 66 ms, reduce-scatter
134 ms, all-gather 120 ms), although the all-reduce moves at least as many bytes. When
the caller's buffer is scratch (a gradient bucket about to be dropped, or a parameter
buffer that is rewritten from the shards anyway), ``reduce_scatter_scratch`` and
``all_gather_scratch`` therefore run as one all-reduce on gloo: the reduce-scatter
reduces the whole buffer and returns this rank's slice of it; the all-gather zeroes
the other ranks' slices and sums (``x + 0`` is exact, so every rank gets the same bits
the all-gather would give, except that a ``-0.0`` becomes ``+0.0``). Other backends use
the real collectives. They are counted and diagnosed under their own names. Below
``_GLOO_ALL_GATHER_MIN_NUMEL`` elements gloo's own all-gather is as fast or faster
(6.5M: 13-17 ms against 16-18 ms; 13M: 56 ms against 34 ms), so smaller all-gathers stay
real; the reduce-scatter was never faster (``bench/bench_collectives.py``).
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.comm._deadline import DeadlineWaiter, note_group_timeout
from shardwise.comm._exit import note_failure
from shardwise.comm._hang_watch import HangWatch
from shardwise.comm._logger import OpTimer, comms_logger
from shardwise.comm._shm import CollectiveMismatch, SharedMemoryAllReduce, open_shared

logger = logging.getLogger(__name__)

_GLOO_ALL_GATHER_MIN_NUMEL = 8_000_000
"""From this size an all-gather on gloo runs as an all-reduce (see [Note: gloo
reduce-scatter and all-gather by all-reduce])."""
_LOG_NAMES = {
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_to_all": "all_to_all_single",
}
"""The comms logger's (DeepSpeed's) names for the ops whose Communicator name differs."""
_DIAG_PREFIX = "shardwise/diag"
_DIAG_GRACE_S = 5.0
"""The longest a failing rank waits for its peers' states (half the deadline if shorter):
a peer stuck in another collective reaches its own deadline within about the skew of
their starts, and the job's exit waits on this grace."""

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message says where every rank was."""


@dataclass(frozen=True)
class CollectiveRecord:
    """What one collective was, for counting and for error messages."""

    seq: int
    op: str
    numel: int
    dtype: torch.dtype
    tag: str
    timer: OpTimer | None = field(default=None, compare=False, repr=False)
    """Set when the comms logger times this collective; stopped when its wait completes."""

    def describe(self) -> str:
        tag = f" [{self.tag}]" if self.tag else ""
        return f"{self.op} #{self.seq} ({self.numel} x {str(self.dtype).removeprefix('torch.')}){tag}"


def blocking_wait(backend: str, environ) -> bool:
    """Whether waits on ``backend``'s collectives block the Python thread (see [Note:
    stream-ordered waits]): always for gloo; for NCCL only when ``TORCH_NCCL_BLOCKING_WAIT``
    asks for it, as in PyTorch."""
    if backend != "nccl":
        return True
    return environ.get("TORCH_NCCL_BLOCKING_WAIT", environ.get("NCCL_BLOCKING_WAIT", "0")).strip() == "1"


class Handle:
    """An in-flight collective; :meth:`wait` blocks until done or raises CollectiveError.

    ``honours_timeout``: the work's own ``wait(timeout)`` bounds it (see [Note: deadlines on
    every collective]), so a blocking wait needs no helper thread."""

    def __init__(
        self, comm: Communicator | None, work, record: CollectiveRecord | None, *, honours_timeout: bool = False
    ):
        self._comm, self._work, self._record = comm, work, record
        self._honours_timeout = honours_timeout

    def wait(self) -> None:
        """Wait for the collective: see [Note: stream-ordered waits] for NCCL and [Note:
        deadlines on every collective] in ``_deadline.py`` for the others."""
        if self._work is None:
            return
        work, self._work = self._work, None
        comm = self._comm
        if not comm.blocking_wait:
            work.wait()  # the current stream waits; this thread goes on
            comm.watch_stream_ordered(self._record)
        else:
            try:
                if comm.native_deadline or self._honours_timeout:
                    completed = work.wait(timeout=comm.timeout)
                else:
                    completed = comm.waiter.wait(work, comm.timeout.total_seconds())
            except RuntimeError as exc:
                raise comm.diagnose(self._record, exc) from exc
            if completed is False:
                raise comm.diagnose(self._record, None)
        if self._record.timer is not None:  # see [Note: the comms logger] in _logger.py
            self._record.timer.stop()


_DONE = Handle(None, None, None)


class Communicator:
    """Collectives over one process group, numbered, counted and bounded in time.

    Args:
        group: the process group (None = the default group).
        timeout_s: how long a wait may block before it is diagnosed as a hang.
        name: a label used in error messages (e.g. ``"data-parallel"``).
        check_hangs: exchange what every rank waited in when a collective fails (False:
            the error names this rank's collective only, and comes without the grace
            period spent waiting for the peers' states).
        shared_memory: on gloo, run CPU all-reduces (sums) and all-gathers through memory
            shared by the ranks when they all run on one host (see [Note: shared-memory all-reduce] in
            ``_shm.py``); the grid's tensor and data groups ask for it.
    """

    def __init__(
        self,
        group=None,
        *,
        timeout_s: float = 1800.0,
        name: str = "world",
        check_hangs: bool = True,
        shared_memory: bool = False,
    ):
        self.group = group
        self.name = name
        self.check_hangs = check_hangs
        self.timeout = timedelta(seconds=timeout_s)
        note_group_timeout(group, self.timeout)  # see [Note: the deadline of a process group]
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self.blocking_wait = blocking_wait(backend, os.environ)
        """Whether :meth:`Handle.wait` blocks this thread, with the deadline and diagnosis
        (see [Note: stream-ordered waits])."""
        self.native_deadline = backend == "nccl"
        """Whether ``work.wait(timeout)`` bounds every collective kind (NCCL's blocking
        waits do); otherwise waits go through :attr:`waiter` (see [Note: deadlines on
        every collective])."""
        self.gloo_waits_natively = backend == "gloo"
        """Whether gloo's own ``wait(timeout)`` bounds this group's all-reduces, broadcasts,
        all-gathers, all-to-alls and point-to-point transfers (it does not bound its reduce-scatter), so
        they are waited on this thread, without the helper thread's hand-off (about 200 us
        per collective on a loaded 2-core machine); see [Note: deadlines on every collective]."""
        self.scratch_by_all_reduce = backend == "gloo"
        """Whether ``reduce_scatter_scratch`` runs as an all-reduce, and
        ``all_gather_scratch`` from ``scratch_gather_min_numel`` elements (see [Note: gloo
        reduce-scatter and all-gather by all-reduce])."""
        self.scratch_gather_min_numel = _GLOO_ALL_GATHER_MIN_NUMEL
        self._shm_wanted = shared_memory and backend == "gloo" and self.world_size > 1
        self._shm: SharedMemoryAllReduce | None = None
        self.waiter = DeadlineWaiter()
        self._hang_watch: HangWatch | None = None
        self.calls: Counter[str] = Counter()
        """Number of collectives issued, by op name."""
        self.bytes: Counter[str] = Counter()
        """Payload bytes of the collectives issued, by op name."""
        self._seq = 0

    def _record(self, op: str, tensor: torch.Tensor, tag: str) -> CollectiveRecord:
        """Number and count a collective about to start (``tensor``: the payload counted
        in :attr:`bytes`; an all-gather's output), timed if the comms logger selects it."""
        timer = self._start_timer(op, tensor) if comms_logger.enabled else None
        return self._count(op, tensor, tag, timer)

    def _count(self, op: str, tensor: torch.Tensor, tag: str, timer: OpTimer | None) -> CollectiveRecord:
        """Number and count a collective whose timing the caller chose (the functional API)."""
        self._seq += 1
        self.calls[op] += 1
        self.bytes[op] += tensor.numel() * tensor.element_size()
        return CollectiveRecord(self._seq, op, tensor.numel(), tensor.dtype, tag, timer)

    def _start_timer(self, op: str, tensor: torch.Tensor) -> OpTimer | None:
        # The logger's message size is the input's (see [Note: the comms logger]); an
        # all-gather is counted here by its output, world_size inputs.
        size = tensor.numel() * tensor.element_size()
        if op == "all_gather":
            size //= self.world_size
        name = _LOG_NAMES.get(op, op)
        return comms_logger.start(name, name, size, self.world_size, tensor.device)

    def all_reduce(self, tensor: torch.Tensor, *, op=dist.ReduceOp.SUM, tag: str = "") -> Handle:
        """Start an in-place all-reduce of ``tensor``; returns a handle to wait on."""
        if self.world_size == 1:
            return _DONE
        if self._shm_wanted and op == dist.ReduceOp.SUM and tensor.device.type == "cpu":
            done = self._through_shared_memory("all_reduce", tensor, tensor, tag)
            if done is not None:
                return done
        record = self._record("all_reduce", tensor, tag)
        return Handle(
            self,
            dist.all_reduce(tensor, op=op, group=self.group, async_op=True),
            record,
            honours_timeout=self.gloo_waits_natively,
        )

    def _through_shared_memory(self, op: str, output: torch.Tensor, tensor: torch.Tensor, tag: str) -> Handle | None:
        """``op`` (an all-reduce of ``tensor``, or an all-gather of it into ``output``) done
        through shared memory, or None where that does not apply (the mapping is set up on
        the first call that would use it, by all ranks together)."""
        if self._shm is None:
            self._shm = open_shared(self)
            if self._shm is None:
                self._shm_wanted = False
                return None
        summed = op == "all_reduce"
        if not SharedMemoryAllReduce.eligible(tensor, summed=summed) or not output.is_contiguous():
            return None
        record = self._record(op, output, tag)
        timeout_s = self.timeout.total_seconds()
        try:
            done = (
                self._shm.all_reduce(tensor, timeout_s) if summed else self._shm.all_gather(output, tensor, timeout_s)
            )
        except CollectiveMismatch as exc:
            self._shm_wanted = False
            raise self.diagnose(record, exc) from None
        if not done:
            self._shm_wanted = False
            raise self.diagnose(record, None)
        if record.timer is not None:
            record.timer.stop()
        return _DONE

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, tag: str = "") -> Handle:
        """Start an in-place broadcast from group rank ``src``."""
        if self.world_size == 1:
            return _DONE
        record = self._record("broadcast", tensor, tag)
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        return Handle(
            self,
            dist.broadcast(tensor, src_global, group=self.group, async_op=True),
            record,
            honours_timeout=self.gloo_waits_natively,
        )

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, *, tag: str = "") -> Handle:
        """Start gathering every rank's ``input`` into ``output`` (rank-major)."""
        if self.world_size == 1:
            output.copy_(input.reshape(output.shape))
            return _DONE
        if self._shm_wanted and input.device.type == "cpu" and output.numel() == input.numel() * self.world_size:
            done = self._through_shared_memory("all_gather", output, input, tag)
            if done is not None:
                return done
        record = self._record("all_gather", output, tag)
        work = _all_gather_single(output, input, group=self.group, async_op=True)
        return Handle(self, work, record, honours_timeout=self.gloo_waits_natively)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        tag: str = "",
    ) -> Handle:
        """Start sending slice ``j`` of ``input`` (``world_size`` slices along dim 0, equal
        or of ``input_split_sizes`` rows) to rank ``j``; slice ``r`` of ``output`` (equal or
        of ``output_split_sizes`` rows) receives rank ``r``'s."""
        if self.world_size == 1:
            output.copy_(input)
            return _DONE
        record = self._record("all_to_all", input, tag)
        work = dist.all_to_all_single(
            output,
            input,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=self.group,
            async_op=True,
        )
        return Handle(self, work, record, honours_timeout=self.gloo_waits_natively)

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, *, op=dist.ReduceOp.SUM, tag: str = ""
    ) -> Handle:
        """Start reducing ``input`` across ranks, leaving this rank's slice in ``output``."""
        if self.world_size == 1:
            output.copy_(input.reshape(output.shape))
            return _DONE
        record = self._record("reduce_scatter", input, tag)
        work = _reduce_scatter_single(output, input, op=op, group=self.group, async_op=True)
        return Handle(self, work, record)

    def reduce_scatter_scratch(self, buffer: torch.Tensor, *, tag: str = "") -> tuple[Handle, torch.Tensor]:
        """Start reducing ``buffer`` (``world_size`` equal slices, its contents may be
        overwritten) across ranks; returns the handle and the tensor that holds this
        rank's reduced slice once it completes. See [Note: gloo reduce-scatter and
        all-gather by all-reduce]."""
        shard = buffer.numel() // self.world_size
        local = buffer[self.rank * shard : (self.rank + 1) * shard]
        if self.world_size == 1:
            return _DONE, local
        if not self.scratch_by_all_reduce:
            out = torch.empty(shard, dtype=buffer.dtype, device=buffer.device)
            return self.reduce_scatter_tensor(out, buffer, tag=tag), out
        record = self._record("reduce_scatter", buffer, tag)
        return Handle(
            self,
            dist.all_reduce(buffer, group=self.group, async_op=True),
            record,
            honours_timeout=self.gloo_waits_natively,
        ), local

    def all_gather_scratch(self, buffer: torch.Tensor, *, tag: str = "") -> Handle:
        """Start filling ``buffer`` (``world_size`` equal slices) with every rank's slice,
        this rank's being in place already. See [Note: gloo reduce-scatter and all-gather
        by all-reduce]."""
        if self.world_size == 1:
            return _DONE
        shard = buffer.numel() // self.world_size
        low, high = self.rank * shard, (self.rank + 1) * shard
        if self._shm_wanted and buffer.device.type == "cpu":
            done = self._through_shared_memory("all_gather", buffer, buffer[low:high], tag)
            if done is not None:
                return done
        if not self.scratch_by_all_reduce or buffer.numel() < self.scratch_gather_min_numel:
            return self.all_gather_into_tensor(buffer, buffer[low:high].clone(), tag=tag)
        record = self._record("all_gather", buffer, tag)
        with torch.no_grad():
            buffer[:low].zero_()
            buffer[high:].zero_()
        return Handle(
            self,
            dist.all_reduce(buffer, group=self.group, async_op=True),
            record,
            honours_timeout=self.gloo_waits_natively,
        )

    def barrier(self, *, tag: str = "") -> None:
        """Block until every rank of the group arrives (implemented as a tiny all-reduce,
        read back so that the thread waits on NCCL too)."""
        token = torch.zeros(1, device=self._device())
        self.all_reduce(token, tag=tag or "barrier").wait()
        token.item()

    def all_gather_object(self, obj, *, tag: str = "", counted: bool = True) -> list:
        """Every rank's picklable ``obj``, indexed by group rank (small metadata only).

        Two all-gathers (sizes, then the padded pickles) under the same deadline as every
        collective; they count as one ``all_gather_object`` call. Pickle travels between
        this job's own ranks here; nothing read from disk is unpickled. ``counted=False``
        leaves it out of :attr:`calls` (the library's own set-up exchanges)."""
        if self.world_size == 1:
            return [obj]
        if counted:
            self.calls["all_gather_object"] += 1
        device = self._device()
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        self._uncounted(
            _all_gather_single,
            sizes,
            torch.tensor([payload.numel()], device=device),
            op="all_gather_object sizes",
            tag=tag,
        ).wait()
        sizes = sizes.tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
        padded[: payload.numel()] = payload
        gathered = torch.empty(self.world_size * padded.numel(), dtype=torch.uint8, device=device)
        self._uncounted(_all_gather_single, gathered, padded, op="all_gather_object", tag=tag).wait()
        rows = gathered.cpu().view(self.world_size, -1)
        return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(sizes)]

    def _uncounted(self, start, output: torch.Tensor, input: torch.Tensor, *, op: str, tag: str) -> Handle:
        self._seq += 1
        record = CollectiveRecord(self._seq, op, output.numel(), output.dtype, tag)
        return Handle(self, start(output, input, group=self.group, async_op=True), record)

    def all_reduce_scalars(
        self, values: list[float], *, op=dist.ReduceOp.SUM, tag: str = "", device=None
    ) -> list[float]:
        """All-reduce a few Python numbers in one fp64 collective and return them."""
        tensor = torch.tensor(values, dtype=torch.float64, device=device or self._device())
        self.all_reduce(tensor, op=op, tag=tag).wait()
        return tensor.tolist()

    def watch_stream_ordered(self, record: CollectiveRecord) -> None:
        """Have the hang watch follow a collective whose wait did not block (NCCL): see
        [Note: watching stream-ordered collectives] in ``_hang_watch.py``."""
        if self._hang_watch is None:
            self._hang_watch = HangWatch(self)
        event = torch.cuda.Event()
        event.record()
        self._hang_watch.add(record, event.query)

    def _device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def diagnose(self, record: CollectiveRecord, exc: BaseException | None) -> CollectiveError:
        """Build the error for a failed collective. See [Note: hang diagnosis].

        This process counts as failed from here on, even if the caller catches the error:
        see [Note: exit after a failure] in ``_exit.py``."""
        note_failure(1)
        global_rank = dist.get_rank()
        mine = f"{self.name} group rank {self.rank}: {record.describe()}"
        peers = (
            _exchange_diagnosis(
                global_rank, dist.get_world_size(), mine, grace_s=min(_DIAG_GRACE_S, self.timeout.total_seconds() / 2)
            )
            if self.check_hangs
            else {}
        )
        reason = str(exc).splitlines()[0][:300] if exc is not None else ""
        if exc is None or "timed out" in reason.lower():
            cause = f"did not complete within {self.timeout.total_seconds():g} s"
        else:
            cause = f"failed: {reason}"
        lines = [f"rank {global_rank} waited in {mine} which {cause}."]
        for peer, state in peers.items():
            lines.append(f"  rank {peer}: " + (state or "published nothing (dead, or busy outside any collective)"))
        if not self.check_hangs:
            lines.append("  (what the other ranks waited in was not exchanged: comm.check_hangs is false)")
        lines.append(
            "Ranks that issue different collectives have diverged (e.g. a data-"
            "dependent branch or a save called on some ranks only); a rank that "
            "published nothing has crashed or is stuck: check its log."
        )
        return CollectiveError("\n".join(lines))


def _exchange_diagnosis(rank: int, world_size: int, mine: str, *, grace_s: float) -> dict[int, str | None]:
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_DIAG_PREFIX}/{rank}", mine)
    except Exception:  # noqa: BLE001 - the store may be gone with the dead peer; diagnose without it
        return {}
    found: dict[int, str | None] = {}
    deadline = time.monotonic() + grace_s
    for peer in range(world_size):
        if peer == rank:
            continue
        key = f"{_DIAG_PREFIX}/{peer}"
        remaining = max(deadline - time.monotonic(), 0.05)
        try:
            store.wait([key], timedelta(seconds=remaining))
            found[peer] = store.get(key).decode()
        except Exception:  # noqa: BLE001 - a peer that never wrote is reported as silent
            found[peer] = None
    return found
