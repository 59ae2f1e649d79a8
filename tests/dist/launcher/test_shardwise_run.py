"""`shardwise run` starts real training on 2 and 4 CPU ranks, on one or two "nodes"."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("train_script.py")


def _env(tmp_path, **extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu", **extra)
    return env


def _run(args, tmp_path, timeout=180, **env):
    return subprocess.run(
        [sys.executable, "-m", "shardwise.cli", "run", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(tmp_path, **env),
    )


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_infos(text):
    return sorted(
        (int(m[1]), int(m[2]), int(m[3]), int(m[4]))
        for m in re.finditer(r"RANKINFO rank=(\d+) local_rank=(\d+) world=(\d+) passed_local_rank=(\d)", text)
    )


def _checksums(text):
    return {m[1] for m in re.finditer(r"DONE rank=\d+ steps=3 checksum=(-?\d+\.\d{6})", text)}


@pytest.mark.parametrize("nproc", [4])  # 2 ranks: every other launched test (demo, scripts, examples)
def test_single_node(tmp_path, nproc):
    proc = _run(["--nproc", str(nproc), "--master_port", str(_free_port()), str(SCRIPT)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _rank_infos(proc.stdout) == [(r, r, nproc, 1) for r in range(nproc)]
    assert len(_checksums(proc.stdout)) == 1  # every rank ends with the same parameters


def test_two_nodes_started_by_hand(tmp_path):
    port = str(_free_port())
    common = ["--num_nodes", "2", "--master_addr", "127.0.0.1", "--master_port", port, "--nproc", "1"]
    env = _env(tmp_path)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardwise.cli",
                "run",
                *common,
                "--node_rank",
                str(n),
                "--no_local_rank",
                str(SCRIPT),
            ],
            cwd=tmp_path,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for n in (0, 1)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert _rank_infos(outs[0][0] + outs[1][0]) == [(0, 0, 2, 0), (1, 0, 2, 0)]
    assert len(_checksums(outs[0][0] + outs[1][0])) == 1


def test_hostfile_of_two_hosts_over_a_remote_shell(tmp_path):
    (tmp_path / "hostfile").write_text("node-a slots=1\nnode-b slots=1  # second machine\n")
    (tmp_path / ".shardwise_env").write_text("MY_VAR=from-env-file\n")
    fake_ssh = tmp_path / "fake_ssh.py"
    fake_ssh.write_text(
        "import os, sys\nhost, command = sys.argv[1], sys.argv[2]\nos.execvp('bash', ['bash', '-c', command])\n"
    )
    proc = _run(
        ["--hostfile", "hostfile", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(SCRIPT)],
        tmp_path,
        SHARDWISE_SSH=f"{sys.executable} {fake_ssh}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _rank_infos(proc.stdout) == [(0, 0, 2, 1), (1, 0, 2, 1)]
    assert proc.stdout.count("MY_VAR=from-env-file") == 2
    assert len(_checksums(proc.stdout)) == 1


def test_include_of_unknown_host_is_an_error(tmp_path):
    (tmp_path / "hostfile").write_text("node-a slots=2\n")
    proc = _run(["--hostfile", "hostfile", "--include", "node-z", str(SCRIPT)], tmp_path)
    assert proc.returncode == 2
    assert "host 'node-z' in --include is not in the hostfile (hosts: node-a)" in proc.stderr


def test_crashing_rank_stops_the_job(tmp_path):
    marker = f"crash-marker-{os.getpid()}"
    start = time.monotonic()
    proc = _run(
        [
            "--nproc",
            "2",
            "--master_port",
            str(_free_port()),
            str(SCRIPT),
            "--crash_rank",
            "1",
            "--steps",
            "50",
            "--deepspeed_config",
            marker,
        ],
        tmp_path,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 60
    assert "rank 1 (local rank 1" in proc.stderr and "failed first" in proc.stderr
    assert "RuntimeError: injected failure on rank 1" in proc.stderr
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"


def test_rank_that_aborts_in_native_code_prints_its_python_stack(tmp_path):
    script = tmp_path / "abort_on_rank1.py"
    script.write_text(
        "import os\n"
        "import time\n"
        "def crash_here():\n"
        "    os.abort()\n"
        "if os.environ['RANK'] == '1':\n"
        "    crash_here()\n"
        "time.sleep(60)\n"
    )
    proc = _run(["--nproc", "2", "--master_port", str(_free_port()), str(script)], tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "Fatal Python error: Aborted" in proc.stderr, proc.stderr[-3000:]
    assert re.search(r'File ".*abort_on_rank1.py", line 4 in crash_here', proc.stderr), proc.stderr[-3000:]
