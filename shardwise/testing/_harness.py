"""Run a function on N ranks of a real gloo process group, the way tests need it.

Each rank is a process forked from a server that imported torch and shardwise once, reused
by later calls of the same world size while calls succeed (see [Note: the rank pool] in ``_pool.py``). Ranks
rendezvous through a new ``file://`` store in a private directory for every call (no
ports to race for), use one CPU thread each, and get a collective timeout so a divergence
fails instead of hanging. Whatever a rank raises comes back to the caller with its rank
and traceback; if one rank fails, the others get a short grace period to report and are
then stopped.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.testing import _pool

_GRACE_AFTER_FAILURE_S = 15.0


class DistributedTestError(AssertionError):
    """One or more ranks failed; the message holds every rank's traceback."""


def run_distributed(
    fn: Callable[..., Any],
    *,
    world_size: int,
    tmp_path: str | os.PathLike | None = None,
    timeout_s: float = 180.0,
    collective_timeout_s: float = 60.0,
    fresh_processes: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` gloo ranks and return results.

    ``fn`` must be a module-level function (it is pickled by name) and its return value
    must pickle. The default process group exists while ``fn`` runs and is destroyed after.
    The rank processes of a call that succeeded on every rank serve the next call of the
    same world size, reset to the state they started in (see [Note: the rank pool]).

    Args:
        fn: the body each rank runs.
        world_size: number of ranks.
        tmp_path: a directory for the rendezvous file (pytest's ``tmp_path``); a private
            temporary directory when None.
        timeout_s: deadline for the whole run; ranks still running then are killed and the
            call raises, naming them.
        collective_timeout_s: the process group timeout, which bounds every collective.
        fresh_processes: start ranks for this call alone, which exit after it: for a body
            whose test checks process start or exit, or that leaves process-wide state
            behind that the reset does not cover (``sys.modules`` entries, singletons).
        **kwargs: passed to ``fn``; must pickle.

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        DistributedTestError: a rank raised, died, or the deadline passed.
    """
    payload = pickle.dumps((fn, kwargs))
    with tempfile.TemporaryDirectory(dir=tmp_path) as rendezvous_dir:
        setup = {
            "init_file": str(Path(rendezvous_dir) / "rendezvous"),
            "collective_timeout_s": collective_timeout_s,
            "environ": dict(os.environ),
            "sys_path": list(sys.path),
            "cwd": os.getcwd(),
        }
        ranks = _pool.take(world_size, fresh=fresh_processes)
        succeeded = False
        try:
            ranks.submit(setup, payload)
            outcome = _collect(ranks.procs, ranks.results, timeout_s)
            succeeded = all(status == "ok" for status, _ in outcome.values())
        finally:
            _pool.give_back(ranks, succeeded=succeeded)
    errors = {rank: msg for rank, (status, msg) in outcome.items() if status != "ok"}
    if errors:
        body = "\n".join(f"--- rank {rank} ---\n{msg}" for rank, msg in sorted(errors.items()))
        raise DistributedTestError(
            f"{len(errors)} of {world_size} ranks failed in {getattr(fn, '__name__', fn)}:\n{body}"
        )
    return [pickle.loads(outcome[rank][1]) for rank in range(world_size)]


def _collect(procs, results, timeout_s: float) -> dict[int, tuple[str, Any]]:
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    reason = f"did not finish within the {timeout_s:.0f} s deadline"
    while len(outcome) < len(procs):
        now = time.monotonic()
        if now >= deadline:
            break
        try:
            rank, status, value = results.get(timeout=min(0.2, deadline - now))
            outcome[rank] = (status, value)
            if status != "ok":
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
                reason = "was stopped after another rank failed"
            continue
        except queue.Empty:
            pass
        for rank, proc in enumerate(procs):
            if rank not in outcome and not proc.is_alive() and proc.exitcode is not None:
                time.sleep(0.2)  # its result may still be in flight through the queue
                try:
                    while True:
                        r, status, value = results.get_nowait()
                        outcome[r] = (status, value)
                except queue.Empty:
                    pass
                if rank not in outcome:
                    outcome[rank] = ("died", f"process exited with code {proc.exitcode} without reporting a result")
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
                    reason = "was stopped after another rank failed"
    for rank in range(len(procs)):
        outcome.setdefault(rank, ("timeout", reason))
    return outcome
