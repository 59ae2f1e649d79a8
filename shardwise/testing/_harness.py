"""Run a function on N ranks of a real gloo process group, the way tests need it.

Each rank is a fresh process started with the spawn method. Ranks rendezvous through a
``file://`` store in a private directory (no ports to race for), use one CPU thread each,
and get a collective timeout so a divergence fails instead of hanging. Whatever a rank
raises comes back to the caller with its rank and traceback; if one rank fails, the
others get a short grace period to report and are then stopped.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

_GRACE_AFTER_FAILURE_S = 15.0


class DistributedTestError(AssertionError):
    """One or more ranks failed; the message holds every rank's traceback."""


def _worker(fn, rank: int, world_size: int, init_file: str, collective_timeout_s: float, results, kwargs: dict) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
        SHARDWISE_ACCELERATOR="cpu",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        value = fn(rank, world_size, **kwargs)
        # plain pickle copies tensor data; the queue's default would share memory with a
        # process that is about to exit
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        # Report before tearing down: destroying a group with a stuck collective blocks.
        results.put((rank, "error", traceback.format_exc()))
        return
    dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    *,
    world_size: int,
    tmp_path: str | os.PathLike | None = None,
    timeout_s: float = 180.0,
    collective_timeout_s: float = 60.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` gloo ranks and return results.

    ``fn`` must be a module-level function (it is pickled by name) and its return value
    must pickle. The default process group exists while ``fn`` runs and is destroyed after.

    Args:
        fn: the body each rank runs.
        world_size: number of ranks to spawn.
        tmp_path: a directory for the rendezvous file (pytest's ``tmp_path``); a private
            temporary directory when None.
        timeout_s: deadline for the whole run; ranks still running then are killed and the
            call raises, naming them.
        collective_timeout_s: the process group timeout, which bounds every collective.
        **kwargs: passed to ``fn``; must pickle.

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        DistributedTestError: a rank raised, died, or the deadline passed.
    """
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(dir=tmp_path) as rendezvous_dir:
        init_file = str(Path(rendezvous_dir) / "rendezvous")
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                name=f"shardwise-rank{rank}",
                args=(fn, rank, world_size, init_file, collective_timeout_s, results, kwargs),
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            outcome = _collect(procs, results, timeout_s)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=5)
            results.close()
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
