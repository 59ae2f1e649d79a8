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
``SystemExit`` that ends the main thread (see [Note: seeing a SystemExit]). An exception
that ends only a background thread is not one: the process goes on, and if the main
thread then waits for a peer, the deadline catches that.

[Note: seeing a SystemExit]
Python handles an uncaught ``SystemExit`` before ``sys.excepthook`` and keeps its status
from every hook an exit handler can read (before Python 3.12 nothing short of tracing
every call sees it go by). Under ``shardwise run`` the entry wrapper catches it around
the script. Under plain ``torchrun`` the hooks wrap ``sys.exit`` (which ``argparse``
errors and ``sys.exit(main())`` go through): a call from the main thread records its
status, which counts at exit if the main thread's outermost frame ended by an exception
rather than by returning, i.e. if no one caught that ``SystemExit``. A status of 0 or
None is the clean path. ``raise SystemExit(n)`` and the builtin ``exit(n)`` bypass
``sys.exit``: under plain torchrun they take the clean path, exit barrier included.

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

import dis
import functools
import logging
import os
import sys
import threading
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)

EXIT_BARRIER_TIMEOUT = timedelta(seconds=60)

_state = {"installed": False, "failure_status": None, "exit_status": None, "main_frame": None}
_RETURNS = frozenset(dis.opmap[name] for name in ("RETURN_VALUE", "RETURN_CONST") if name in dis.opmap)
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
    return _uncaught_exit_status()


def _uncaught_exit_status() -> int | None:
    """The non-zero status of a ``sys.exit`` that ends the main thread, or None (see [Note:
    seeing a SystemExit])."""
    status, frame = _state["exit_status"], _state["main_frame"]
    if status is None or status == 0:
        return None
    if (
        frame is not None
        and 0 <= frame.f_lasti < len(frame.f_code.co_code)
        and frame.f_code.co_code[frame.f_lasti] in _RETURNS
    ):
        return None  # the main thread went on after the SystemExit and returned
    return status if isinstance(status, int) else 1


def _noting_status(exit_fn):
    @functools.wraps(exit_fn)
    def exit(status=None, /):
        if threading.current_thread() is threading.main_thread():
            _state["exit_status"] = status
        exit_fn(status)

    return exit


def _outermost_frame_of_main_thread():
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and frame.f_back is not None:
        frame = frame.f_back
    return frame


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
    sys.exit = _noting_status(sys.exit)  # see [Note: seeing a SystemExit]
    _state["main_frame"] = _outermost_frame_of_main_thread()
    atexit.register(shutdown_at_exit)


def shutdown_at_exit() -> None:
    """Leave the job: see [Note: exit after a failure] and [Note: exit barrier]."""
    status = failure_status()
    _state["main_frame"] = None
    if not dist.is_initialized():
        return
    if status is not None and dist.get_world_size() > 1:
        exit_now(status)
    try:
        if dist.get_world_size() > 1:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=EXIT_BARRIER_TIMEOUT)
            else:
                dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a peer that died already: nothing left to coordinate with
        logger.debug("process group shutdown at exit: %s", exc)


def exit_now(status: int) -> None:
    """Flush stdio and the logging handlers, then end the process without teardown."""
    for handler in logging.getLogger().handlers + logger.handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
            pass
    os._exit(status)
