"""The node launcher (``shardwise.launcher.node``) without training: the variables each rank
gets, and how the first failure ends the node's other processes and names the failing rank.
(tests/dist/launcher starts real training jobs through it.)"""

import signal
import subprocess
import sys
import time

from shardwise.launcher.node import Exit, JobSpec, rank_env, report_failure, wait_all


def test_ranks_get_torchruns_variables_numbered_across_nodes():
    spec = JobSpec(script="t.py", script_args=[], nproc_per_node=2, num_nodes=3, node_rank=1,
                   master_addr="10.0.0.1", master_port=2345)  # fmt: skip
    env = rank_env(spec, 1)
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "6"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "3"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "2345")


def _start(code):
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_the_first_failure_stops_the_others_and_gives_its_code():
    sleeper = _start("import time; time.sleep(60)")
    failing = _start("import sys, time; time.sleep(0.2); sys.exit(3)")
    start = time.monotonic()
    ended = wait_all([sleeper, failing], interval_s=0.02)
    assert (ended.code, ended.local_rank) == (3, 1)
    assert sleeper.returncode == -signal.SIGTERM  # stopped, not waited for
    assert time.monotonic() - start < 10


def test_a_rank_killed_by_a_signal_is_named_with_it(tmp_path, capsys):
    killed = _start("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    ended = wait_all([killed], interval_s=0.02)
    assert ended.code == 128 + signal.SIGKILL
    report_failure(str(tmp_path), Exit(ended.code, rank=5, local_rank=ended.local_rank))
    assert "rank 5 (local rank 0) was ended by SIGKILL and recorded no error" in capsys.readouterr().err


def test_all_ranks_succeeding_is_success():
    procs = [_start("pass") for _ in range(2)]
    assert wait_all(procs, interval_s=0.02) == Exit(0)
    assert all(proc.returncode == 0 for proc in procs)
