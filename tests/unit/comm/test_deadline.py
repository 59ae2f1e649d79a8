"""Waits with a deadline whatever the work object honours (see [Note: deadlines on every
collective]), and the exit hooks installed whoever initialised the process group."""

import threading
import time
from datetime import timedelta

import pytest
import torch

from shardwise.comm import _init
from shardwise.comm._collectives import CollectiveError, CollectiveRecord, Handle
from shardwise.comm._deadline import DeadlineWaiter


class _Work:
    """A work object like gloo's reduce-scatter: ``wait`` ignores any timeout and
    ``is_completed`` never turns true."""

    def __init__(self, error=None):
        self.finish, self.error, self.waits = threading.Event(), error, 0

    def is_completed(self):
        return False

    def wait(self):
        self.waits += 1
        self.finish.wait()
        if self.error is not None:
            raise self.error
        return True


class _CompletedWork:
    def is_completed(self):
        return True

    def wait(self):
        self.thread = threading.current_thread()
        return True


RELEASE_S = 3.0
"""When a test's hung fake work is released anyway, so that a wait which ignores its
deadline returns (completed) and fails the test instead of blocking it until the test
runner's own timeout."""


def _released_later(work):
    timer = threading.Timer(RELEASE_S, work.finish.set)
    timer.start()
    return timer


def test_a_wait_that_ignores_timeouts_ends_at_the_deadline():
    waiter, work = DeadlineWaiter(), _Work()
    timer = _released_later(work)
    start = time.monotonic()
    assert waiter.wait(work, 0.2) is False
    assert 0.2 <= time.monotonic() - start < 2
    timer.cancel()
    work.finish.set()


def test_the_next_wait_after_a_deadline_gets_a_fresh_helper():
    waiter, hung, later = DeadlineWaiter(), _Work(), _Work()
    timer = _released_later(hung)
    assert waiter.wait(hung, 0.05) is False
    later.finish.set()
    assert waiter.wait(later, 5) is True  # not queued behind the hung one
    timer.cancel()
    hung.finish.set()


class _Comm:
    """What ``Handle.wait`` reads of a gloo Communicator."""

    blocking_wait, native_deadline = True, False

    def __init__(self, timeout_s):
        self.timeout = timedelta(seconds=timeout_s)
        self.waiter = DeadlineWaiter()
        self.diagnosed = []

    def diagnose(self, record, exc):
        self.diagnosed.append(record)
        return CollectiveError(f"rank 0 waited in {record.describe()}, which did not complete")


def test_a_collective_that_ignores_timeouts_raises_the_deadline_error():
    comm, work = _Comm(timeout_s=0.2), _Work()
    record = CollectiveRecord(5, "reduce_scatter", 16, torch.float32, "gradient bucket 2")
    timer = _released_later(work)
    with pytest.raises(CollectiveError, match=r"waited in reduce_scatter #5 \(16 x float32\) \[gradient bucket 2\]"):
        Handle(comm, work, record).wait()
    assert comm.diagnosed == [record]
    timer.cancel()
    work.finish.set()


def test_a_completed_collective_returns_and_errors_reach_the_caller():
    waiter, work = DeadlineWaiter(), _Work()
    threading.Timer(0.05, work.finish.set).start()
    assert waiter.wait(work, 5) is True
    failing = _Work(error=RuntimeError("Connection closed by peer"))
    failing.finish.set()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        waiter.wait(failing, 5)


def test_a_finished_collective_is_read_back_without_the_helper():
    work = _CompletedWork()
    assert DeadlineWaiter().wait(work, 5) is True
    assert work.thread is threading.current_thread()


def test_exit_hooks_are_installed_when_the_group_was_initialised_elsewhere(monkeypatch):
    installed = []
    monkeypatch.setattr(_init.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(_init, "install_exit_hooks", lambda: installed.append(True))
    _init.init_distributed()
    _init.init_distributed(dist_init_required=False)
    assert installed == [True, True]
