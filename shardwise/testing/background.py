"""Start the launched jobs of a pytest module in the background, a few at a time.

A test that launches a job (``shardwise run``, ``torchrun``, an example script) waits for
its processes: for their imports, for a deadline to pass, for a launcher to stop the peers.
Two ranks on a small machine rarely fill its cores for the whole job, so a module starts its
jobs in background threads, in the order its tests run, a few at a time, and each test waits
for the result of its own job only: one job's start-up overlaps another's wait. Each job
still runs as processes of its own, in a working directory of its own, and times itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def in_background(
    request: Any, tmp_path_factory: Any, job_for: Callable[[Any], Callable[[Path], Any] | None], *, at_once: int
) -> Iterator[dict[str, Future]]:
    """Start the job of every test of ``request``'s module that this session runs, in the
    order they run, at most ``at_once`` at a time; leaving the block waits for those started.

    Args:
        request: the ``request`` of a module-scoped pytest fixture.
        tmp_path_factory: pytest's; every job gets a new directory of its own from it.
        job_for: a test item's job, as a callable of that directory, or None for a test
            without one.
        at_once: how many jobs run at the same time.

    Yields:
        {test name: Future of the job's result}; a test takes its own with
        ``jobs[request.node.name].result()``, which re-raises what the job raised.
    """
    items = [item for item in request.session.items if item.module is request.module]
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        jobs = {}
        for item in items:
            job = job_for(item)
            if job is not None:
                jobs[item.name] = pool.submit(job, tmp_path_factory.mktemp("job"))
        try:
            yield jobs
        finally:
            for job in jobs.values():
                job.cancel()  # those not started yet: an interrupted session waits for no more
