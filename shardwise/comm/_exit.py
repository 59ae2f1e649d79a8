"""How a rank leaves the job: cleanly after success, at once after a failure.

[Note: exit after a failure]
A rank that fails must not wait for its peers: the launcher stops the other ranks only
once one has exited, and a peer that diverged or stalls may never arrive. Two things
would hold a failed rank back. The exit barrier (below) waits for peers that will not
come. And tearing the process group down joins gloo's worker threads, which block as
long as a collective is in flight: one the deadline gave up on never ends. So after a
failure the exit hook skips both and ends the process with ``os._exit`` once stdio and
the logging handlers are flushed (the traceback is printed and the launcher's error
record written by then; atexit handlers registered before ours are skipped).

A failure is: an exception no one caught in the main thread (seen by a chained
``sys.excepthook``, and by ``sys.last_value`` / ``sys.last_exc`` if another library
replaced the hook without chaining), a ``CollectiveError`` raised in this process even
if the script caught it (its collective may still be in flight), or a non-zero
``SystemExit`` the launcher's entry wrapper saw. An exception that ends only a
background thread is not one: the process goes on, and if the main thread then waits
for a peer, the deadline catches that.

[Note: exit barrier]
After success the hook waits until every rank has finished (a monitored barrier on
gloo) and then destroys the process group. Scripts written for DeepSpeed rarely call
``destroy_process_group()``; without it a gloo group is torn down during interpreter
teardown, and a rank whose peers exited first can abort there ("terminate called
without an active exception", SIGABRT) although training succeeded. The hook is
installed whoever initialised the process group (``init_distributed`` installs it on its
early return too, e.g. when Accelerate initialised the group first).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)

EXIT_BARRIER_TIMEOUT = timedelta(seconds=60)

_state = {"installed": False, "failure_status": None}
_lock = threading.Lock()


def note_failure(status: int = 1) -> None:
    """Record that this process failed, so that its exit skips the barrier and teardown
    (see [Note: exit after a failure]). The first status recorded is the exit status."""
    with _lock:
        if _state["failure_status"] is None:
            _state["failure_status"] = status if isinstance(status, int) and status != 0 else 1


def failure_status() -> int | None:
    """The exit status of a failure noted so far, or None."""
    if _state["failure_status"] is not None:
        return _state["failure_status"]
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return 1
    return None


def install_exit_hooks() -> None:
    """Chain ``sys.excepthook`` and register the exit hook, once per process."""
    import atexit

    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        if not issubclass(exc_type, KeyboardInterrupt):
            note_failure(1)
        else:
            note_failure(130)
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
    atexit.register(shutdown_at_exit)


def shutdown_at_exit() -> None:
    """Leave the job: see [Note: exit after a failure] and [Note: exit barrier]."""
    if not dist.is_initialized():
        return
    status = failure_status()
    if status is not None and dist.get_world_size() > 1:
        exit_now(status)
    try:
        if dist.get_world_size() > 1:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=EXIT_BARRIER_TIMEOUT)
            else:
                dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # a peer that died already: nothing left to coordinate with
        logger.debug("process group shutdown at exit: %s", exc)


def exit_now(status: int) -> None:
    """Flush stdio and the logging handlers, then end the process without teardown."""
    for handler in logging.getLogger().handlers + logger.handlers:
        try:
            handler.flush()
        except Exception:  # a closed stream: nothing to flush
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)
