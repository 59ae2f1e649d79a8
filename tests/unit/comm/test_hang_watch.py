"""The hang watch of stream-ordered (NCCL) collectives: a collective still running past the
deadline is diagnosed and ends the process; finished ones are dropped and end nothing."""

import time
from datetime import timedelta

from shardwise.comm import _hang_watch
from shardwise.comm._collectives import CollectiveRecord
from shardwise.comm._hang_watch import HangWatch


class _Comm:
    def __init__(self, timeout_s):
        self.timeout = timedelta(seconds=timeout_s)
        self.diagnosed = []

    def diagnose(self, record, exc):
        self.diagnosed.append((record, exc))
        return RuntimeError(f"rank 0 waited in {record.describe()} which did not complete")


def _wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_collective_past_its_deadline_is_diagnosed_and_ends_the_process(monkeypatch):
    ended = []
    monkeypatch.setattr(_hang_watch, "_end_process", ended.append)
    comm = _Comm(timeout_s=0.2)
    watch = HangWatch(comm)
    finished = CollectiveRecord(1, "all_gather", 8, None, "parameters of unit 0 (Linear)")
    stuck = CollectiveRecord(2, "reduce_scatter", 16, None, "gradient bucket 3")
    watch.add(finished, lambda: True)
    watch.add(stuck, lambda: False)
    assert _wait_for(lambda: ended)
    assert "reduce_scatter #2" in ended[0] and "gradient bucket 3" in ended[0], ended
    assert [record for record, _ in comm.diagnosed] == [stuck]


def test_finished_collectives_are_dropped_and_end_nothing(monkeypatch):
    ended = []
    monkeypatch.setattr(_hang_watch, "_end_process", ended.append)
    comm = _Comm(timeout_s=0.2)
    watch = HangWatch(comm)
    done_after = time.monotonic() + 0.1  # finishes well within the deadline
    for seq in range(5):
        watch.add(CollectiveRecord(seq, "all_reduce", 1, None, ""), lambda: time.monotonic() > done_after)
    assert _wait_for(lambda: watch.pending() == 0)
    time.sleep(0.4)
    assert not ended and not comm.diagnosed
