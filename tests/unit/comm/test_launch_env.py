import pytest

from shardwise.comm import discover_launch_env
from shardwise.comm._init import first_slurm_host

_LAUNCH_VARS = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
]


@pytest.fixture
def clean_env(monkeypatch):
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_plain_python_is_world_of_one(clean_env):
    env = discover_launch_env()
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")


def test_torchrun_env(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("MASTER_ADDR", "10.0.0.1")
    clean_env.setenv("MASTER_PORT", "1234")
    env = discover_launch_env()
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 4, 1, "10.0.0.1", 1234)


def test_slurm_env(clean_env):
    clean_env.setenv("SLURM_PROCID", "5")
    clean_env.setenv("SLURM_NTASKS", "8")
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("SLURM_JOB_NODELIST", "gpu[07-09,12]")
    env = discover_launch_env()
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.source) == (5, 8, 1, "gpu07", "slurm")


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("a[3-5],b1", "a3"), ("n[010,2]", "n010")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_openmpi_single_node(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "1")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    env = discover_launch_env()
    assert (env.rank, env.world_size, env.master_addr, env.source) == (1, 2, "127.0.0.1", "openmpi")


def test_openmpi_multi_node_needs_master_addr(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "1")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "4")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set"):
        discover_launch_env()


def test_bad_rank_variable(clean_env):
    clean_env.setenv("RANK", "x")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK must be an integer, got 'x'"):
        discover_launch_env()


def test_shardwise_run_is_named_as_the_launcher(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert discover_launch_env().source == "torchrun"
    monkeypatch.setenv("SHARDWISE_ERROR_DIR", "/tmp/x")  # what shardwise run's node launcher sets
    assert discover_launch_env().source == "shardwise run"
