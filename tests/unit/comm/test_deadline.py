"""Waits with a deadline whatever the work object honours (see [Note: deadlines on every
collective]), and the exit hooks installed whoever initialised the process group."""

import threading
import time

import pytest

from shardwise.comm import _init
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


def test_a_wait_that_ignores_timeouts_ends_at_the_deadline():
    waiter, work = DeadlineWaiter(), _Work()
    start = time.monotonic()
    assert waiter.wait(work, 0.2) is False
    assert 0.2 <= time.monotonic() - start < 2
    work.finish.set()


def test_the_next_wait_after_a_deadline_gets_a_fresh_helper():
    waiter, hung, later = DeadlineWaiter(), _Work(), _Work()
    assert waiter.wait(hung, 0.05) is False
    later.finish.set()
    assert waiter.wait(later, 5) is True  # not queued behind the hung one
    hung.finish.set()


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
