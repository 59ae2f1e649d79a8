"""Rank processes for ``run_distributed``, kept alive between calls of one world size.

[Note: the rank pool]
Starting a rank costs a Python start and the imports of torch, shardwise and
``torch._dynamo`` (which torch's optimizers import on first use), about 5 s of CPU per
rank: more than most test bodies. Two things keep that off the tests. Ranks are forked
from a server process that imported all of it once (``multiprocessing``'s forkserver,
preloading ``_rank_preload``; importing them starts no thread, so forking is safe), so a
new rank costs a fork and the body's own imports. And the ranks of a call that succeeded
on every rank stay alive, waiting for the next call of the same
world size in this interpreter. Each call still runs in a new gloo process group on a
new ``file://`` store; after reporting its result a rank leaves that group together with
its peers (a barrier, then the group is destroyed) and says so, and only ranks that all
said so serve again. Each rank first returns to the state it was started in (see [Note:
what a reused rank resets]).

A call that did not succeed everywhere (a rank raised or died, the deadline passed, the
caller was interrupted) kills its ranks: the next call spawns new ones, so a stuck
collective or a half-torn-down group never reaches another test. ``fresh=True`` ranks
serve one call and exit, as every rank did before the pool. A rank that has gathered too
many threads (leftovers of earlier calls' process groups, see ``_MAX_THREADS``) retires
after its call. Idle ranks exit when the
interpreter that owns them exits (an ``atexit`` hook asks, then kills) or, should it be
killed, when their task pipe closes with it.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import queue
import time
import traceback
from datetime import timedelta

_STOP_WAIT_S = 5.0
_LEAVE_WAIT_S = 60.0
_MAX_THREADS = 64
"""A rank with more threads than this after a call retires (the next call spawns a new
one). An engine's autograd hooks tie it to its parameters through C++, out of reach of
the garbage collector, so each engine a body builds outlives its call together with its
process groups, whose gloo threads keep polling their closed sockets: in a spawned rank
that ended with the process, in a reused one it adds up to CPU time taken from the next
calls."""


class Ranks:
    """``world_size`` rank processes, each reading its calls from a pipe; one queue for the
    calls' results and one for the ranks' word that they have left a call's group."""

    def __init__(self, world_size: int, *, fresh: bool) -> None:
        ctx = _context()
        self.world_size, self.fresh = world_size, fresh
        self.results, self.left = ctx.Queue(), ctx.Queue()
        pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
        self.tasks = [sender for _, sender in pipes]
        self.procs = [
            ctx.Process(
                target=_serve,
                daemon=True,
                name=f"shardwise-rank{rank}",
                args=(rank, world_size, receiver, self.results, self.left, fresh),
            )
            for rank, (receiver, _) in enumerate(pipes)
        ]
        for proc in self.procs:
            proc.start()
        for receiver, _ in pipes:
            receiver.close()  # the children hold it now; a dead child then reads as a broken pipe

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def left_cleanly(self) -> bool:
        """Wait until every rank has left the last call's group; False if one could not or died."""
        deadline, count = time.monotonic() + _LEAVE_WAIT_S, 0
        while count < self.world_size and time.monotonic() < deadline and self.alive():
            try:
                if not self.left.get(timeout=0.2):
                    return False
                count += 1
            except queue.Empty:
                pass
        return count == self.world_size and self.alive()

    def submit(self, setup: dict, body: bytes) -> None:
        """Hand every rank one call: ``setup`` (plain data) and the pickled ``(fn, kwargs)``."""
        for tasks in self.tasks:
            try:
                tasks.send((setup, body))
            except OSError:  # the rank died; collecting the results reports it
                pass

    def stop(self, *, wait_s: float = 0.0) -> None:
        """End the processes: asked to leave when ``wait_s`` > 0, killed if still there."""
        if wait_s > 0:
            for tasks in self.tasks:
                try:
                    tasks.send(None)
                except OSError:  # already gone
                    pass
            for proc in self.procs:
                proc.join(timeout=wait_s)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        for tasks in self.tasks:
            tasks.close()
        self.results.close()
        self.left.close()


def _context():
    """Ranks fork from a server that imported torch and shardwise once (``_rank_preload``)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["shardwise.testing._rank_preload"])
    return ctx


_idle: dict[int, Ranks] = {}


def take(world_size: int, *, fresh: bool) -> Ranks:
    """Ranks for one call: the idle ones of this world size if alive, else newly spawned."""
    if not fresh:
        ranks = _idle.pop(world_size, None)
        if ranks is not None and ranks.alive():
            return ranks
        if ranks is not None:
            ranks.stop()
    return Ranks(world_size, fresh=fresh)


def give_back(ranks: Ranks, *, succeeded: bool) -> None:
    """After a call: keep the ranks of a call that succeeded everywhere once they have left
    its group (before its rendezvous file goes), end any others."""
    if succeeded and not ranks.fresh and ranks.world_size not in _idle and ranks.left_cleanly():
        _idle[ranks.world_size] = ranks
    else:
        ranks.stop()


@atexit.register
def _stop_idle() -> None:
    while _idle:
        _, ranks = _idle.popitem()
        ranks.stop(wait_s=_STOP_WAIT_S)


def _serve(rank: int, world_size: int, tasks, results, left, fresh: bool) -> None:
    """A rank's life: calls one after another until told to stop, a call fails, or (with
    ``fresh``) after its one call."""
    os.environ.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu")
    import torch

    import shardwise
    from shardwise.testing._process_state import ProcessBaseline

    # The whole package now, before the first call, so the first call's module attributes
    # are recorded and put back like every later call's ([Note: lazy package import]).
    dir(shardwise)

    torch.set_num_threads(1)
    baseline = ProcessBaseline()
    while True:
        task = _next_task(tasks)
        if task is None or not _run_call(rank, world_size, task, baseline, results, left) or fresh:
            return


def _next_task(tasks):
    """The next call, or None: told to stop, or the parent is gone (its end of the pipe
    closes with it, so an idle rank never outlives it)."""
    try:
        return tasks.recv()
    except EOFError:
        return None


def _run_call(rank: int, world_size: int, task, baseline, results, left) -> bool:
    """Run one call and report it; False when this process must not serve another."""
    import torch.distributed as dist

    from shardwise.testing._process_state import ModuleGlobals, after_call

    setup, body = task
    try:
        baseline.restore(environ=setup["environ"], sys_path=setup["sys_path"], cwd=setup["cwd"])
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            OMP_NUM_THREADS="1",
            SHARDWISE_ACCELERATOR="cpu",
        )
        fn, kwargs = pickle.loads(body)
        module_globals = ModuleGlobals(getattr(fn, "__module__", ""))
        dist.init_process_group(
            "gloo",
            init_method=f"file://{setup['init_file']}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=setup["collective_timeout_s"]),
        )
        # plain pickle copies tensor data; the queue's default would share memory with a
        # process that may exit or reuse it
        value = pickle.dumps(fn(rank, world_size, **kwargs))
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        # Report before tearing down: destroying a group with a stuck collective blocks.
        results.put((rank, "error", traceback.format_exc()))
        return False
    results.put((rank, "ok", value))
    try:
        # The ranks leave together: one that destroyed its group at once could cut off a
        # peer still connecting to it (a body without collectives does not wait for peers).
        if dist.is_initialized():  # unless the body ended the group itself
            dist.barrier()
            dist.destroy_process_group()
        module_globals.restore()
        del fn, kwargs, module_globals
        after_call()
    except BaseException:  # noqa: BLE001 - the call succeeded; only this process is spoiled
        left.put(False)
        return False
    retire = _thread_count() > _MAX_THREADS
    left.put(not retire)
    return not retire


def _thread_count() -> int:
    """This process's threads, native ones included (0 without procfs)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0
