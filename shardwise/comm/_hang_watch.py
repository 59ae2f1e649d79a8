"""Hang diagnosis for collectives whose waits do not block (NCCL).

[Note: watching stream-ordered collectives]
A stream-ordered wait (see [Note: stream-ordered waits]) returns at once, so no deadline
can fire in it; a hung collective shows up later as the training thread blocked in the
GPU runtime (the next read of a GPU value), out of reach of a Python exception. So each
such wait hands its collective to a :class:`HangWatch` as an event recorded on the current
stream right after the wait (so it passes when the collective has finished; holding the
event rather than the work object keeps no tensor alive), and a daemon thread polls the
events (a query never blocks). One still running ``timeout`` after it was waited for
gets the same diagnosis as a blocking wait (see [Note: hang diagnosis]): which
collective this rank waited in, and what every peer published. The diagnosis is logged and the
process ends with exit status 1, as PyTorch's own NCCL watchdog ends it, but within
``comm.timeout_s`` and naming the bucket or module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from shardwise.comm._error_record import record_error
from shardwise.comm._exit import exit_now

logger = logging.getLogger(__name__)


def _end_process(message: str) -> None:
    """Log the diagnosis, leave it for ``shardwise run`` to report, and end the process
    (the training thread cannot be interrupted)."""
    logger.critical("%s", message)
    record_error(f"CollectiveError: {message}")
    exit_now(1)


class HangWatch:
    """Polls stream-ordered collectives from a daemon thread (see [Note: watching
    stream-ordered collectives]).

    Args:
        comm: the communicator whose ``timeout`` and ``diagnose`` apply.
    """

    def __init__(self, comm):
        self.comm = comm
        self.poll_s = min(1.0, comm.timeout.total_seconds() / 4)
        self._watched: list[tuple[float, object, Callable[[], bool]]] = []  # (since, record, is_completed)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, record, is_completed: Callable[[], bool]) -> None:
        """Watch the collective ``record`` describes until ``is_completed()`` (which must
        not block) says it has finished."""
        with self._lock:
            self._watched.append((time.monotonic(), record, is_completed))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shardwise-hang-watch", daemon=True)
                self._thread.start()

    def pending(self) -> int:
        """Collectives watched and not seen complete yet."""
        with self._lock:
            return len(self._watched)

    def _run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            hung = self._check()
            if hung is not None:
                _end_process(str(self.comm.diagnose(hung, None)))
                return

    def _check(self):
        """Drop completed collectives; the record of one past its deadline, if any."""
        deadline = time.monotonic() - self.comm.timeout.total_seconds()
        with self._lock:
            self._watched = [entry for entry in self._watched if not entry[2]()]
            late = [record for since, record, _ in self._watched if since < deadline]
        return late[0] if late else None
