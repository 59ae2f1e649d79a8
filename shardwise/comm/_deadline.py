"""Waiting for a collective with a deadline that every backend and collective kind honours.

[Note: deadlines on every collective]
A blocking wait must end when the collective completes or when ``comm.timeout_s`` has
passed, whichever comes first. ``work.wait(timeout=...)`` alone does not guarantee it:
gloo honours the timeout for all-reduce, all-gather, broadcast, reduce, gather,
scatter, all-to-all, barrier and point-to-point (torch 2.13), but its reduce-scatter
returns a work object whose ``wait`` ignores the timeout, whose ``is_completed()`` never
turns true and which has no future, so a rank that waits in a reduce-scatter its peers
never join blocks until a peer's process ends. So the wait itself runs on a helper
thread (one per communicator, started on the first wait): it blocks in ``work.wait()``
with the GIL released, and the caller waits on an event with the deadline. Blocking
waits on both sides, no polling: an idle waiter costs nothing, and each wait costs one
thread hand-off (about 20 us on an idle core, but about 200 us per small all-reduce on a
loaded 2-core machine, where the extra wake-up waits for a core). A collective that has
completed already is read back on the caller's thread without the hand-off, and a
caller that knows its work honours the timeout says so (``Handle(...,
honours_timeout=True)``) and waits on its own thread, as on NCCL.

After a deadline passes, the helper is still blocked in the hung collective; the caller
raises ``CollectiveError`` and gets a fresh helper if it waits again. The process is then
expected to end: see [Note: exit after a failure] in ``_exit.py``, which also keeps a
helper that is still blocked from meeting interpreter teardown.

[Note: the deadline of a process group]
A process group's collectives get one deadline wherever they are issued from: the
shortest ``timeout_s`` of the Communicators built over the group in this process. The
engine builds its own from ``comm.timeout_s``; the functional API (``_functional.py``),
whose calls carry no config, builds one with the timeout the group was created with and
reads the shortest back at each call, so a script's ``dist.all_reduce`` gets the
engine's deadline once there is an engine, and the group's own timeout before. Each
``Communicator`` records its timeout here when it is built.
"""

from __future__ import annotations

import queue
import threading
import weakref
from datetime import timedelta

import torch.distributed as dist

_shortest_timeouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""ProcessGroup -> the shortest timeout recorded for it (see [Note: the deadline of a
process group]); weak, so that a destroyed group leaves nothing behind."""


def note_group_timeout(group, timeout: timedelta) -> None:
    """Record that a Communicator over ``group`` (None: the default group) waits at most
    ``timeout``."""
    key = dist.group.WORLD if group is None else group
    known = _shortest_timeouts.get(key)
    if known is None or timeout < known:
        _shortest_timeouts[key] = timeout


def group_timeout(group) -> timedelta | None:
    """The deadline recorded for ``group`` (a ProcessGroup, not None), or None."""
    return _shortest_timeouts.get(group)


class _Done(threading.Event):
    """Set when the helper's ``work.wait()`` has returned or raised (``error``)."""

    error: BaseException | None = None


class DeadlineWaiter:
    """Blocks in ``work.wait()`` on a helper thread so that the caller can give up at a
    deadline (see [Note: deadlines on every collective])."""

    def __init__(self):
        self._jobs: queue.SimpleQueue | None = None

    def wait(self, work, timeout_s: float) -> bool:
        """Wait for ``work``; True when it completed, False when ``timeout_s`` passed first.

        Raises what ``work.wait()`` raises (a failed collective, e.g. a peer's connection
        closed)."""
        if work.is_completed():
            work.wait()
            return True
        done = _Done()
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name="shardwise-collective-wait", daemon=True).start()
        self._jobs.put((work, done))
        if not done.wait(timeout_s):
            self._jobs = None  # its thread is stuck in the hung collective; the next wait starts another
            return False
        if done.error is not None:
            raise done.error
        return True


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        work, done = jobs.get()
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, which raises it
            done.error = exc
        done.set()
        del work, done  # hold no tensor between waits
