"""`shardwise run` on one machine: two jobs at once each get their own rendezvous port, and
a port that is taken is an error naming it (see [Note: choosing the master port])."""

import os
import socket
import subprocess
import sys

SCRIPT = """
import os
import sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
# one write per line: both ranks share the launcher's stdout (see train_script.py)
sys.stdout.write(f"RESULT rank={dist.get_rank()} port={os.environ['MASTER_PORT']} sum={int(total)}\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


def _start(tmp_path, *flags):
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu")
    return subprocess.Popen(
        [sys.executable, "-m", "shardwise.cli", "run", "--nproc", "2", *flags, "--no_local_rank", str(script)],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_two_jobs_on_one_machine_at_once_both_succeed(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    procs = [_start(first), _start(second)]
    outs = [proc.communicate(timeout=180) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    ports = []
    for stdout, _ in outs:
        lines = sorted(line for line in stdout.splitlines() if line.startswith("RESULT"))
        assert [line.split()[1] for line in lines] == ["rank=0", "rank=1"]
        assert {line.split()[3] for line in lines} == {"sum=2"}
        ports.append({line.split()[2] for line in lines})
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1]


def test_a_master_port_in_use_is_an_error_naming_it(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = _start(tmp_path, "--master_port", str(port))
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr[-3000:]
    assert f"shardwise run: --master_port {port} is already in use on this machine" in stderr
    assert "leave --master_port out" in stderr
    assert "Traceback" not in stderr
