"""Optimizer state on NVMe: in memory only for the sub-group being stepped.

[Note: optimizer swapping]
The optimizer keeps one fp32 master shard per ZeRO bucket. With
``offload_optimizer.device = "nvme"`` each master's state tensors (Adam's ``exp_avg`` and
``exp_avg_sq``, SGD's momentum, ...), and the master itself when it is a separate copy
of the parameters, live in swap files between steps. The step walks the masters in
sub-groups of about ``sub_group_size`` elements: read the group's files, step the
optimizer on that group alone (only its masters carry a ``.grad`` then, so torch's
optimizers skip the others), hand the updated masters to the strategy to copy into the
parameters, write the files back, drop the tensors. The next group's reads are issued
before the current group steps and the writes complete behind the following groups, so
I/O overlaps compute; at most ``buffer_count`` sub-groups are in memory at once. The
scalar ``step`` counters stay in memory. Checkpoints see the state through
:meth:`OptimizerSwapper.resident`, which swaps a few masters in and back out.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import os
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import nn

from shardwise.offload._aio import SwapIO, SwapRecord
from shardwise.offload._nvme import SwapPathError, make_swap_dir, remove_swap_dir, reserve

_MASTER = "__master__"
"""The key a master's own values are swapped under."""


def state_tensors_per_param(optimizer: torch.optim.Optimizer) -> int:
    """How many parameter-sized state tensors ``optimizer`` keeps (to size the swap space)."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if group.get("amsgrad") else 2
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group.get("momentum", 0) else 0
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1
    return 2


class OptimizerSwapper:
    """Swap ``optimizer``'s state for ``masters`` to files (see [Note: optimizer swapping]).

    Args:
        optimizer: the optimizer over ``masters``.
        masters: fp32 master shards, in step order.
        folder: this rank's swap directory.
        io: the file I/O pool.
        sub_group_size: most elements stepped (and read ahead) together; a larger master
            is a sub-group of its own.
        buffer_count: sub-groups in memory at once (>= 2 overlaps reads with the step).
        pinned: indices of masters whose values are never swapped (their state still is).
        swap_masters: whether the masters' values are swapped too (they are separate
            copies of the parameters, e.g. fp32 masters of bf16 parameters).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: list[nn.Parameter],
        *,
        folder: Path,
        io: SwapIO,
        sub_group_size: int,
        buffer_count: int,
        swap_masters: bool,
        pinned: frozenset[int] = frozenset(),
    ):
        self.optimizer, self.masters, self.folder, self.io = optimizer, masters, folder, io
        self.grads = [m.grad for m in masters]
        """Each master's gradient shard; attached only while its sub-group steps (a swapped-out
        master is empty, and torch refuses a gradient of another size)."""
        for m in masters:
            m.grad = None
        self.buffer_count = buffer_count
        self.swap_masters = swap_masters
        self.pinned = pinned
        self.sub_groups: list[list[int]] = []
        current: list[int] = []
        numel = 0
        for i, master in enumerate(masters):  # at most sub_group_size elements, or one master
            if current and numel + master.numel() > sub_group_size:
                self.sub_groups.append(current)
                current, numel = [], 0
            current.append(i)
            numel += master.numel()
        if current:
            self.sub_groups.append(current)
        self._numel = [m.numel() for m in masters]
        self._records: dict[tuple[int, str], SwapRecord] = {}
        self._keys_on_disk: list[dict[str, None]] = [{} for _ in masters]  # ordered, unlike a set
        self._resident = set(range(len(masters)))
        self._empty = torch.empty(0, dtype=torch.float32)
        self.peak_bytes = 0
        """The most bytes of swapped-kind tensors in memory during a step: sub-groups resident,
        being read, or being written (tests bound it by buffer_count)."""
        self._finalizer = weakref.finalize(self, _close, io, folder)
        reserved = folder / "reserved"
        self._reserved = reserved.stat().st_size if reserved.exists() else 0
        """Bytes still held by the start-up reservation; each new swap file takes its share."""

    # -- swapping one set of masters in and out -------------------------------------------------

    def _path(self, index: int, key: str) -> Path:
        return self.folder / f"{index}.{key}.bin"

    def _start_swap_in(self, members: list[int]) -> list[tuple[int, str, Future]]:
        reads = []
        for i in members:
            if i in self._resident:
                continue
            for key in self._keys_on_disk[i]:
                reads.append((i, key, self.io.read(self._records[(i, key)])))
        return reads

    def _finish_swap_in(self, members: list[int], reads: list[tuple[int, str, Future]]) -> None:
        for i, key, future in reads:
            tensor = future.result()
            if key == _MASTER:
                self.masters[i].data = tensor
            else:
                self.optimizer.state[self.masters[i]][key] = tensor
        self._resident.update(members)

    def _swapped_keys(self, i: int) -> list[str]:
        state = self.optimizer.state.get(self.masters[i], {})
        return [
            k
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and k != "step" and v.numel() == self._numel[i] and v.numel() > 1
        ]

    def _start_swap_out(self, members: list[int]) -> list[tuple[int, str, Future]]:
        writes = []
        for i in members:
            master = self.masters[i]
            state = self.optimizer.state.get(master, {})
            for key in self._swapped_keys(i):  # also state loaded while the master was out
                writes.append(self._write(i, key, state.pop(key).contiguous()))
            if self.swap_masters and i in self._resident and i not in self.pinned:
                writes.append(self._write(i, _MASTER, master.data.contiguous()))
                master.data = self._empty
            self._resident.discard(i)
        return writes

    def _write(self, i: int, key: str, tensor: torch.Tensor) -> tuple[int, str, Future]:
        if (i, key) not in self._records and self._reserved:  # hand reserved space to the new file
            self._reserved = max(0, self._reserved - tensor.numel() * tensor.element_size())
            os.truncate(self.folder / "reserved", self._reserved)
        return i, key, self.io.write(self._path(i, key), tensor)

    def _wait(self, writes: list[tuple[int, str, Future]]) -> None:
        for i, key, future in writes:
            self._records[(i, key)] = future.result()  # raises SwapFileError from the I/O thread
            self._keys_on_disk[i][key] = None

    # -- the step ---------------------------------------------------------------------------------

    def step(
        self,
        after_group: Callable[[list[int]], None],
        *,
        timer: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext(),
    ) -> None:
        """Step the optimizer sub-group by sub-group; ``after_group(indices)`` runs while
        those masters are in memory and updated (to copy them into the parameters).
        ``timer`` times the waits for reads (``optimizer_swap_in_state``) and writes
        (``optimizer_swap_out_state``), DeepSpeed's timer names."""
        groups = self.sub_groups
        reads: dict[int, list] = {}
        writes: collections.deque[list] = collections.deque()
        next_read = 0
        for g, members in enumerate(groups):
            # read ahead one sub-group while keeping at most buffer_count in memory
            while next_read < len(groups) and next_read <= g + 1:
                in_memory = len(writes) + len(reads) + (1 if next_read > g else 0)
                if next_read > g and in_memory >= self.buffer_count:
                    if not writes:
                        break
                    with timer("optimizer_swap_out_state"):
                        self._wait(writes.popleft())
                    continue
                reads[next_read] = self._start_swap_in(groups[next_read])
                next_read += 1
            with timer("optimizer_swap_in_state"):
                self._finish_swap_in(members, reads.pop(g))
            self._step_only(members)
            in_flight = [f for batch in writes for f in batch] + [f for batch in reads.values() for f in batch]
            self.peak_bytes = max(self.peak_bytes, self.resident_bytes() + sum(self._bytes(f) for f in in_flight))
            after_group(members)
            writes.append(self._start_swap_out(members))
        with timer("optimizer_swap_out_state"):
            while writes:
                self._wait(writes.popleft())
        release_freed_memory()

    def _step_only(self, members: list[int]) -> None:
        """Step the optimizer on ``members`` alone: only they carry a ``.grad``."""
        for i in members:
            self.masters[i].grad = self.grads[i]
        try:
            self.optimizer.step()
        finally:
            for i in members:
                self.masters[i].grad = None

    # -- access outside the step ---------------------------------------------------------------------

    @contextlib.contextmanager
    def resident(self, indices: list[int]) -> Iterator[None]:
        """Swap these masters (and their state) in for the block, and back out after it."""
        self._finish_swap_in(indices, self._start_swap_in(indices))
        try:
            yield
        finally:
            self._wait(self._start_swap_out(indices))

    def master_swapped(self, i: int) -> bool:
        """Whether master ``i``'s values are in a swap file now (not in memory)."""
        return self.swap_masters and i not in self._resident and i not in self.pinned

    def read_master(self, i: int) -> Future:
        """Start reading master ``i``'s values from its swap file (checked); the master
        itself stays swapped out. For gathering the parameters it holds (stage 3)."""
        return self.io.read(self._records[(i, _MASTER)])

    def swapped_state_dtypes(self, i: int) -> dict[str, torch.dtype]:
        """The optimizer state keys of master ``i`` in swap files, with their dtypes."""
        return {key: self._records[(i, key)].dtype for key in self._keys_on_disk[i] if key != _MASTER}

    def replace_state(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        """Make ``tensors`` master ``i``'s swapped optimizer state (loading a checkpoint):
        they are written to its files now, and files of keys not among them are dropped.
        The master must be swapped out."""
        if i in self._resident:
            raise RuntimeError(f"master {i} is in memory; replace its state between steps")
        for key in [k for k in self._keys_on_disk[i] if k != _MASTER and k not in tensors]:
            del self._keys_on_disk[i][key]
            self._records.pop((i, key))
            self._path(i, key).unlink(missing_ok=True)
        state = self.optimizer.state.get(self.masters[i], {})
        for key in tensors:
            state.pop(key, None)
        self._wait([self._write(i, key, tensor.contiguous()) for key, tensor in tensors.items()])

    def swap_out_all(self) -> None:
        """Write every master in memory out (after construction, or after a state load)."""
        for members in self.sub_groups:
            self._wait(self._start_swap_out(members))
        release_freed_memory()

    def resident_bytes(self) -> int:
        """Bytes of swapped-kind tensors in memory right now (0 between steps)."""
        total = 0
        for i, master in enumerate(self.masters):
            state = self.optimizer.state.get(master, {})
            total += sum(state[k].numel() * state[k].element_size() for k in self._swapped_keys(i))
            if self.swap_masters and i not in self.pinned:
                total += master.numel() * master.element_size()
        return total

    def swapped_bytes(self) -> int:
        """Bytes held in swap files."""
        return sum(r.nbytes for r in self._records.values())

    def _bytes(self, pending: tuple[int, str, Future]) -> int:
        return self._numel[pending[0]] * 4  # masters and their states are fp32

    def close(self) -> None:
        """Stop the I/O threads and delete the swap files (also done when collected)."""
        self._finalizer()


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; a no-op
    elsewhere). The tensors swapped out were mostly below glibc's mmap threshold, so their
    memory went back to the heap, not the system: without this a process that has just
    written its optimizer state to nvme keeps that much memory resident."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def _close(io: SwapIO, folder: Path) -> None:
    io.close()
    remove_swap_dir(folder)


def build_optimizer_swapper(
    optimizer: torch.optim.Optimizer,
    masters: list[nn.Parameter],
    *,
    comm,
    nvme_path: str,
    aio,
    sub_group_size: int,
    buffer_count: int,
    swap_masters: bool,
    pinned: frozenset[int] = frozenset(),
    key: str = "zero_optimization.offload_optimizer.nvme_path",
) -> OptimizerSwapper:
    """Check and reserve ``nvme_path`` on every rank (all raise if any rank cannot use it),
    then swap the masters' state out. Collective."""
    need = sum(m.numel() * 4 for m in masters) * state_tensors_per_param(optimizer)
    if swap_masters:
        need += sum(m.numel() * 4 for i, m in enumerate(masters) if i not in pinned)
    error, folder = None, None
    try:
        folder = make_swap_dir(nvme_path, key=key, rank=comm.rank, need_bytes=need)
        reserve(folder / "reserved", need, key=key)
    except Exception as exc:  # noqa: BLE001 - any failure here must reach the other ranks, or they would wait forever
        error = str(exc) if isinstance(exc, SwapPathError) else f"{type(exc).__name__}: {exc} (nvme_path {nvme_path!r})"
    errors = [(rank, e) for rank, e in enumerate(comm.all_gather_object(error)) if e]
    if errors:
        if folder is not None:
            remove_swap_dir(folder)
        ranks = ", ".join(str(r) for r, _ in errors)
        raise SwapPathError(f"offloading the optimizer state to nvme failed on rank(s) {ranks}: {errors[0][1]}")
    # a thread per request in flight: queue_depth requests for each of intra_op_parallelism
    io = SwapIO(block_size=aio.block_size, threads=aio.intra_op_parallelism * aio.queue_depth)
    swapper = OptimizerSwapper(
        optimizer,
        masters,
        folder=folder,
        io=io,
        sub_group_size=sub_group_size,
        buffer_count=buffer_count,
        swap_masters=swap_masters,
        pinned=pinned,
    )
    swapper.swap_out_all()
    return swapper
