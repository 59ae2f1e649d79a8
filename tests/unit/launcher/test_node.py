"""The node launcher (``shardwise.launcher.node``) without training: the variables each rank
gets, and how the first failure ends the node's other processes and names the failing rank.
(tests/dist/launcher starts real training jobs through it.)"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.launcher.node import (
    Exit,
    JobSpec,
    LaunchError,
    parse_core_list,
    rank_command,
    rank_cores,
    rank_env,
    report_failure,
    run_node,
    wait_all,
)


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


def test_core_lists_and_shares():
    assert parse_core_list("1,3-5,7") == [1, 3, 4, 5, 7]
    for bad in ("1,,2", "3-1", "a-b"):
        with pytest.raises(LaunchError, match="--bind_core_list"):
            parse_core_list(bad)
    spec = JobSpec(script="t.py", script_args=[], nproc_per_node=2, bind_cores_to_rank=True, bind_core_list="0-3,8")
    assert rank_cores(spec) == [[0, 1], [2, 3]]  # equal shares; the fifth core is left out
    with pytest.raises(LaunchError, match="1 cores cannot give each of 2 ranks one"):
        rank_cores(JobSpec(script="t.py", script_args=[], nproc_per_node=2, bind_cores_to_rank=True,
                           bind_core_list="4"))  # fmt: skip


def test_rank_commands_as_deepspeeds_launcher_builds_them():
    spec = JobSpec(script="train.py", script_args=["--x", "1"], nproc_per_node=2, python="python")
    assert rank_command(spec, 1) == ["python", "-u", "-m", "shardwise.launcher._entry", "train.py", "--x", "1"]
    spec.module = True
    assert rank_command(spec, 1)[4:6] == ["-m", "train.py"]
    spec.module, spec.no_python = False, True
    assert rank_command(spec, 1) == ["train.py", "--local_rank=1", "--x", "1"]  # --local_rank first
    spec.module = True
    with pytest.raises(LaunchError, match="--no_python and --module cannot be used together"):
        rank_command(spec, 0)


def test_each_rank_logs_to_its_file_pinned_to_its_cores(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs to pin two ranks apart")
    script = tmp_path / "show.sh"
    script.write_text('#!/bin/sh\necho "rank=$RANK omp=$OMP_NUM_THREADS args=$*"\n'
                      "grep Cpus_allowed_list /proc/self/status\n")  # fmt: skip
    script.chmod(0o755)
    spec = JobSpec(script=str(script), script_args=["--x"], nproc_per_node=2, no_python=True,
                   each_rank_log=str(tmp_path / "logs"), bind_cores_to_rank=True,
                   bind_core_list=",".join(map(str, allowed[:2])), monitor_interval_s=0.02)  # fmt: skip
    assert run_node(spec) == 0
    logs = sorted((tmp_path / "logs").iterdir())
    assert [p.name.rpartition("_")[2] for p in logs] == ["rank0.log", "rank1.log"]
    for rank, log in enumerate(logs):
        text = log.read_text()
        assert f"rank={rank} omp=1 args=--local_rank={rank} --x" in text
        assert text.split("Cpus_allowed_list:")[1].strip() == str(allowed[rank])


def test_a_module_runs_as_python_minus_m(tmp_path, monkeypatch):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "job.py").write_text("import sys\nprint('NAME', __name__, 'ARGS', sys.argv[1:])\n")
    monkeypatch.chdir(tmp_path)
    spec = JobSpec(script="mypkg.job", script_args=["--y"], nproc_per_node=1, module=True,
                   each_rank_log=str(tmp_path / "logs"), monitor_interval_s=0.02)  # fmt: skip
    assert run_node(spec) == 0
    (log,) = (tmp_path / "logs").iterdir()
    assert "NAME __main__ ARGS ['--local_rank=0', '--y']" in log.read_text()  # --local_rank first, as DeepSpeed's


def test_save_pid_names_the_launcher_while_it_runs(tmp_path, monkeypatch, capsys):
    from shardwise.launcher.main import main

    script = tmp_path / "check.sh"
    script.write_text('#!/bin/sh\n[ "$(cat /tmp/$PPID.deepspeed)" = "$PPID" ] || exit 7\n')
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert main(["--nproc", "1", "--master_port", "29999", "--save_pid", "--no_python", str(script)]) == 0
    assert f"launcher pid: {os.getpid()}" in capsys.readouterr().out
    assert not os.path.exists(f"/tmp/{os.getpid()}.deepspeed")  # removed at the end


def test_a_launcher_killed_outright_leaves_no_rank(tmp_path):
    marker = tmp_path / "rank.pid"
    script = tmp_path / "sleeper.sh"
    script.write_text(f"#!/bin/sh\necho $$ > {marker}\nexec sleep 60\n")
    script.chmod(0o755)
    launcher = subprocess.Popen([sys.executable, "-m", "shardwise.launcher.node", "--nproc_per_node=1",
                                 "--no_python", str(script)], start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 30
    while not (marker.exists() and marker.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    rank = int(marker.read_text())
    os.kill(launcher.pid, signal.SIGKILL)  # no handler runs: the kernel ends the rank
    launcher.wait()
    while time.monotonic() < deadline:
        try:
            os.kill(rank, 0)
        except ProcessLookupError:
            break
        if _zombie(rank):
            break
        time.sleep(0.02)
    else:
        os.kill(rank, signal.SIGKILL)
        raise AssertionError("the rank outlived its launcher")


def _zombie(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def test_no_ssh_runs_this_machines_share_of_the_hostfile(tmp_path, monkeypatch, capsys):
    from shardwise.launcher.main import main

    (tmp_path / "hostfile").write_text("node-a slots=2\nnode-b slots=2\n")
    script = tmp_path / "env.sh"
    script.write_text('#!/bin/sh\necho "$RANK $LOCAL_RANK $WORLD_SIZE $MASTER_ADDR $MASTER_PORT" > rank$RANK.txt\n')
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    common = ["--hostfile", "hostfile", "--no_ssh", "--no_python", "--master_port", "29511"]
    assert main([*common, "--node_rank", "1", str(script)]) == 0  # the second machine's two ranks
    assert sorted(p.read_text().split() for p in tmp_path.glob("rank*.txt")) == [
        ["2", "0", "4", "node-a", "29511"], ["3", "1", "4", "node-a", "29511"]]  # fmt: skip
    capsys.readouterr()
    assert main([*common, "--node_rank", "2", str(script)]) == 2  # not a host of the file
    assert "--no_ssh needs --node_rank, this machine's place among the 2 hosts" in capsys.readouterr().err
    assert main(["--no_ssh", "--node_rank", "0", "--no_python", str(script)]) == 2
    assert "--no_ssh needs a hostfile naming every machine" in capsys.readouterr().err
    assert main(["--hostfile", "hostfile", "--launcher", "pdsh", "--ssh_port", "2222", str(script)]) == 2
    assert "--ssh_port works with --launcher ssh" in capsys.readouterr().err
