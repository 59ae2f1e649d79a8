"""run_distributed's rank pool: ranks are reused after a success, replaced after a failure,
spawned for one call on request, reset between calls, and gone when their owner exits."""

import logging
import os
import random
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from shardwise.testing import DistributedTestError, run_distributed

_PROBE = "SHARDWISE_RANK_POOL_PROBE"
_REBOUND_BY_A_BODY = "as imported"


def _pid(rank, world_size):
    return os.getpid()


def _raise_on_last_rank(rank, world_size):
    if rank == world_size - 1:
        raise ValueError(f"boom on {rank}")
    return os.getpid()


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids, deadline_s: float = 60.0) -> list:
    end = time.monotonic() + deadline_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.2)
    return [pid for pid in pids if _alive(pid)]


def test_a_successful_call_leaves_its_ranks_to_the_next_call(tmp_path):
    first = run_distributed(_pid, world_size=2, tmp_path=tmp_path)
    assert run_distributed(_pid, world_size=2, tmp_path=tmp_path) == first
    assert len(set(first)) == 2 and os.getpid() not in first


def test_a_failed_call_ends_its_ranks_and_still_reports_the_failing_rank(tmp_path):
    pooled = run_distributed(_pid, world_size=2, tmp_path=tmp_path)
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_last_rank, world_size=2, tmp_path=tmp_path)
    assert "--- rank 1 ---" in str(info.value) and "ValueError: boom on 1" in str(info.value)
    assert _wait_gone(pooled) == []
    after = run_distributed(_pid, world_size=2, tmp_path=tmp_path)
    assert set(after).isdisjoint(pooled)


def test_fresh_processes_serve_one_call_and_exit(tmp_path):
    pooled = run_distributed(_pid, world_size=2, tmp_path=tmp_path)
    fresh = run_distributed(_pid, world_size=2, tmp_path=tmp_path, fresh_processes=True)
    again = run_distributed(_pid, world_size=2, tmp_path=tmp_path, fresh_processes=True)
    assert set(fresh).isdisjoint(pooled) and set(again).isdisjoint(fresh)
    assert _wait_gone(fresh + again) == []
    assert run_distributed(_pid, world_size=2, tmp_path=tmp_path) == pooled


def _leave_threads(rank, world_size, count):
    import threading

    never = threading.Event()
    for _ in range(count):
        threading.Thread(target=never.wait, daemon=True).start()
    return os.getpid()


def test_a_rank_left_with_many_threads_retires(tmp_path):
    """Threads a call leaves behind (an engine's process groups outlive it) end with their
    rank: a few keep it in the pool, many retire it."""
    few = run_distributed(_leave_threads, world_size=2, tmp_path=tmp_path, count=2)
    many = run_distributed(_leave_threads, world_size=2, tmp_path=tmp_path, count=80)
    assert many == few
    assert _wait_gone(many) == []
    assert set(run_distributed(_pid, world_size=2, tmp_path=tmp_path)).isdisjoint(many)


def _observe_then_disturb(rank, world_size, disturb):
    """What a body can see of its process at start; then, with ``disturb``, change all of it."""
    import numpy as np
    import torch.distributed as dist

    from shardwise.comm import comms_logger
    from shardwise.runtime import _checkpointing
    from shardwise.runtime.activation_checkpointing import checkpointing
    from shardwise.utils import groups, log_dist_once

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("shardwise").addHandler(handler)
    log_dist_once("the rank pool probe", level=logging.WARNING)
    logging.getLogger("shardwise").removeHandler(handler)
    seen = {
        "pid": os.getpid(),
        "rank env": (os.environ["RANK"], os.environ.get(_PROBE)),
        "cwd": os.getcwd(),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "draws": (torch.rand(3).tolist(), random.random(), float(np.random.rand())),
        "logger level": logging.getLogger("shardwise").level,
        "warning filters": len(warnings.filters),
        "logged once": len(records),
        "no grid": groups._grid_ref is None,
        "comms records": dict(comms_logger._records),
        "tracker": sorted(checkpointing.get_cuda_rng_tracker().get_states()),
        "module globals": (dist.all_reduce.__qualname__, _checkpointing.CHECKPOINT_PART_BYTES, _REBOUND_BY_A_BODY),
    }
    if disturb:
        os.environ[_PROBE] = "left by the body"
        os.chdir(os.path.dirname(os.getcwd()))
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        torch.set_num_threads(2)
        torch.manual_seed(rank + 7), random.seed(rank), np.random.seed(rank)
        logging.getLogger("shardwise").setLevel(logging.ERROR)
        warnings.simplefilter("ignore")
        groups._set_grid(checkpointing)  # any object a weak reference can hold
        comms_logger.append("all_reduce", "probe", 1.0, 4, world_size)
        checkpointing.model_parallel_cuda_manual_seed(5)
        dist.all_reduce = lambda *args, **kwargs: None
        _checkpointing.CHECKPOINT_PART_BYTES = 3000
        globals()["_REBOUND_BY_A_BODY"] = "by a body"
    return seen


def _environ(rank, world_size):
    return os.environ["RANK"], os.environ.get(_PROBE)


def test_a_reused_rank_starts_each_call_as_a_spawned_rank_would(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = run_distributed(_observe_then_disturb, world_size=2, tmp_path=tmp_path, disturb=True)
    after = run_distributed(_observe_then_disturb, world_size=2, tmp_path=tmp_path, disturb=False)
    for rank, (was, now) in enumerate(zip(before, after)):
        assert now["pid"] == was["pid"], "the second call must reuse the first call's rank"
        for key in set(was) - {"pid"}:
            assert now[key] == was[key], (rank, key)
        assert was["rank env"] == (str(rank), None) and was["cwd"] == str(tmp_path)
        assert was["logged once"] == 1 and was["dtype"] == torch.float32
    monkeypatch.setenv(_PROBE, "set by the caller")
    assert run_distributed(_environ, world_size=2, tmp_path=tmp_path) == [
        ("0", "set by the caller"),
        ("1", "set by the caller"),
    ]


_OWNER = """
    import os, sys
    from shardwise.testing import run_distributed

    def pid(rank, world_size):
        return os.getpid()

    if __name__ == "__main__":
        print(*run_distributed(pid, world_size=2), flush=True)
        if sys.argv[1] == "killed":
            os._exit(0)  # no atexit hooks: the ranks must see their task pipes close
"""


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_idle_ranks_end_with_the_interpreter_that_owns_them(tmp_path, how):
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(_OWNER))
    done = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    pids = [int(word) for word in done.stdout.split()]
    assert len(pids) == 2
    assert _wait_gone(pids) == []
