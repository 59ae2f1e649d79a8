import pytest

from shardwise.launcher import HostfileError, parse_hostfile, parse_selection, select_resources
from shardwise.launcher.environment import env_file_values, export_prefix, exports, read_env_file
from shardwise.launcher.node import JobSpec, node_command
from shardwise.launcher.runner import multinode_commands


def _hostfile(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def test_parse_hostfile_with_comments_and_blank_lines(tmp_path):
    path = _hostfile(tmp_path, "# cluster\nworker-0 slots=4\n\nworker-1 slots=2  # half\n")
    assert parse_hostfile(path) == {"worker-0": 4, "worker-1": 2}


@pytest.mark.parametrize(
    "text,message",
    [
        ("worker-0 slots=4\nworker-1 slot=2\n", "line 2: expected 'hostname slots=N', got 'worker-1 slot=2'"),
        ("worker-0 slots=4\nworker-0 slots=4\n", "line 2: host 'worker-0' is listed twice"),
        ("worker-0 slots=0\n", "line 1: worker-0 must have at least 1 slot"),
        ("# nothing\n", "lists no hosts"),
    ],
)
def test_malformed_hostfile_names_the_line(tmp_path, text, message):
    with pytest.raises(HostfileError, match=message):
        parse_hostfile(_hostfile(tmp_path, text))


def test_missing_hostfile(tmp_path):
    with pytest.raises(HostfileError, match="cannot read hostfile"):
        parse_hostfile(tmp_path / "absent")


def test_selection_syntax():
    assert parse_selection("a:0,2@b") == {"a": [0, 2], "b": None}
    with pytest.raises(HostfileError, match="must be integers"):
        parse_selection("a:x")


HOSTS = {"a": 4, "b": 4, "c": 2}


def test_include_exclude_num_nodes_num_gpus():
    assert select_resources(HOSTS, include="a:1,3@c") == {"a": [1, 3], "c": [0, 1]}
    assert select_resources(HOSTS, exclude="a:0@b") == {"a": [1, 2, 3], "c": [0, 1]}
    assert select_resources(HOSTS, num_nodes=2) == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}
    assert select_resources(HOSTS, num_slots=2) == {"a": [0, 1], "b": [0, 1], "c": [0, 1]}


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"include": "a@zz"}, "host 'zz' in --include is not in the hostfile"),
        ({"exclude": "q"}, "host 'q' in --exclude is not in the hostfile"),
        ({"include": "a", "exclude": "b"}, "mutually exclusive"),
        ({"include": "c:5"}, "c has 2 slots .* slot 5 does not exist"),
        ({"num_nodes": 5}, "--num_nodes 5 but only 3 host"),
        ({"num_slots": 3}, "--num_gpus 3 but c has only 2"),
        ({"exclude": "a@b@c"}, "leaves no hosts"),
    ],
)
def test_selection_errors(kwargs, message):
    with pytest.raises(HostfileError, match=message):
        select_resources(HOSTS, **kwargs)


def test_env_files_and_exports(tmp_path):
    (tmp_path / ".deepspeed_env").write_text("# for switchers\nFOO=bar\nexport BAZ='x y'\n")
    assert read_env_file(tmp_path / ".deepspeed_env") == {"FOO": "bar", "BAZ": "x y"}
    home = tmp_path / "home"
    home.mkdir()
    (home / ".shardwise_env").write_text("FROM_HOME=1\n")
    assert env_file_values(cwd=tmp_path, home=home) == {"FOO": "bar", "BAZ": "x y"}
    assert env_file_values(cwd=home / "none", home=home) == {"FROM_HOME": "1"}
    values = exports({"NCCL_DEBUG": "INFO", "PYTHONPATH": "/x", "SECRET": "no"}, cwd=tmp_path, home=home)
    assert values == {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/x", "FOO": "bar", "BAZ": "x y"}
    assert export_prefix({"A": "x y"}) == "export A='x y'; "
    (tmp_path / ".deepspeed_env").write_text("not a pair\n")
    with pytest.raises(ValueError, match="line 1: expected KEY=VALUE"):
        read_env_file(tmp_path / ".deepspeed_env")


def test_commands_per_launcher():
    spec = JobSpec(
        script="train.py",
        script_args=["--x", "1"],
        nproc_per_node=2,
        num_nodes=2,
        master_addr="a",
        master_port=1234,
        python="python",
    )
    cmd = node_command(spec, node_rank=1)
    assert cmd[:3] == ["python", "-m", "shardwise.launcher.node"]
    assert {"--nnodes=2", "--node_rank=1", "--nproc_per_node=2", "--master_addr=a", "--master_port=1234"} <= set(cmd)
    assert cmd[-3:] == ["train.py", "--x", "1"]
    resources = {"a": [0, 1], "b": [0, 1]}
    ssh = multinode_commands(spec, resources, "ssh", ssh=["ssh"], cuda=True)
    assert [c[:2] for c in ssh] == [["ssh", "a"], ["ssh", "b"]]
    assert "--node_rank=0" in ssh[0][2] and "--node_rank=1" in ssh[1][2]
    assert "CUDA_VISIBLE_DEVICES=0,1" in ssh[0][2]
    pdsh = multinode_commands(spec, resources, "pdsh", ssh=[], cuda=False)[0]
    assert pdsh[:5] == ["pdsh", "-S", "-f", "1024", "-w"] and pdsh[5] == "a,b" and "--node_rank=%n" in pdsh[6]
    srun = multinode_commands(spec, resources, "slurm", ssh=[], cuda=False)[0]
    assert srun[0] == "srun" and "--node_rank=$SLURM_NODEID" in srun[-1]
    mpi = multinode_commands(spec, resources, "mpi", ssh=[], cuda=False)[0]
    assert mpi[0] == "mpirun" and "--node_rank=$OMPI_COMM_WORLD_RANK" in mpi[-1]
