"""Start torch.distributed from whatever launched this process.

Launchers announce ranks through environment variables: torchrun (and ``shardwise run``)
set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; SLURM's srun sets
SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; Open MPI sets OMPI_COMM_WORLD_*; MPICH and
Intel MPI set PMI_RANK / PMI_SIZE. A plain ``python train.py`` sets none of them and runs
as a world of one.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from shardwise.accelerator import get_accelerator
from shardwise.comm._error_record import ERROR_DIR_ENV
from shardwise.comm._exit import install_exit_hooks

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29500
DEFAULT_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    source: str
    """``torchrun``, ``slurm``, ``openmpi``, ``mpich`` or ``single``."""


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``node[03-05,9],gpu1`` (-> ``node03``)."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, _, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def discover_launch_env(*, auto_mpi_discovery: bool = True) -> LaunchEnv:
    """Read rank, world size and rendezvous address from the launcher's environment."""
    env = os.environ
    port = _int_env("MASTER_PORT")
    if _int_env("RANK") is not None and _int_env("WORLD_SIZE") is not None:
        return LaunchEnv(
            _int_env("RANK"),
            _int_env("WORLD_SIZE"),
            _int_env("LOCAL_RANK") or 0,
            env.get("MASTER_ADDR"),
            port,
            "shardwise run" if ERROR_DIR_ENV in env else "torchrun",  # or any launcher setting RANK, WORLD_SIZE
        )
    if _int_env("SLURM_PROCID") is not None and _int_env("SLURM_NTASKS") is not None:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        addr = env.get("MASTER_ADDR") or first_slurm_host(nodes)
        return LaunchEnv(
            _int_env("SLURM_PROCID"), _int_env("SLURM_NTASKS"), _int_env("SLURM_LOCALID") or 0, addr, port, "slurm"
        )
    if auto_mpi_discovery:
        for prefix, source in (("OMPI_COMM_WORLD_", "openmpi"), ("PMI_", "mpich")):
            rank, size = _int_env(prefix + "RANK"), _int_env(prefix + "SIZE")
            if rank is None or size is None:
                continue
            local = _int_env(prefix + "LOCAL_RANK") or _int_env("MPI_LOCALRANKID") or 0
            local_size = _int_env(prefix + "LOCAL_SIZE")
            addr = env.get("MASTER_ADDR")
            if addr is None and local_size == size:
                addr = "127.0.0.1"
            if addr is None and size > 1:
                raise RuntimeError(
                    f"launched by {source} on several nodes but MASTER_ADDR is not set; "
                    "export MASTER_ADDR=<hostname of rank 0> (e.g. mpirun -x MASTER_ADDR=...)"
                )
            return LaunchEnv(rank, size, local, addr, port, source)
    return LaunchEnv(0, 1, 0, env.get("MASTER_ADDR"), port, "single")


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise the default process group (DeepSpeed's ``init_distributed``).

    If torch.distributed is already initialised (by the caller, Accelerate, ...) it only
    installs the exit hooks. The backend is NCCL when CUDA is available and gloo otherwise;
    a process started without any launcher joins a world of one through an in-memory
    store, so no port is opened. At exit, a rank that succeeded waits for the others and
    destroys the process group; a rank that failed exits at once (see [Note: exit after a
    failure] in ``_exit.py``).

    Args:
        dist_backend: ``"nccl"``, ``"gloo"`` or None to pick from the accelerator.
        auto_mpi_discovery: read Open MPI / MPICH variables when no torchrun ones exist.
        distributed_port: MASTER_PORT to use when the launcher did not set one.
        verbose: log the rank layout at INFO.
        timeout: the process group's collective timeout.
        init_method: a torch ``init_method`` URL (``env://``, ``tcp://``, ``file://``).
        dist_init_required: False skips initialisation (the caller owns it).
        config: accepted for DeepSpeed compatibility; unused.
        rank: explicit rank (with ``world_size``), overriding the environment.
        world_size: explicit world size.
    """
    del config
    if dist.is_initialized():
        install_exit_hooks()  # whoever initialised the group: see [Note: exit barrier]
        return
    if dist_init_required is False:
        return
    accelerator = get_accelerator()
    backend = dist_backend or accelerator.backend
    if rank >= 0 and world_size > 0:
        launch = LaunchEnv(
            rank,
            world_size,
            _int_env("LOCAL_RANK") or 0,
            os.environ.get("MASTER_ADDR"),
            _int_env("MASTER_PORT"),
            "explicit",
        )
    else:
        launch = discover_launch_env(auto_mpi_discovery=auto_mpi_discovery)
    if not 0 <= launch.rank < launch.world_size:
        raise ValueError(
            f"rank {launch.rank} is outside world size {launch.world_size} "
            f"(read from {launch.source}); check the launcher's environment"
        )
    os.environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank))
    accelerator.set_device(launch.local_rank)
    if launch.world_size == 1 and init_method is None and launch.master_addr is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        os.environ.setdefault("MASTER_ADDR", launch.master_addr or "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(launch.master_port or distributed_port))
        dist.init_process_group(
            backend,
            init_method=init_method or "env://",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
        )
    install_exit_hooks()
    if verbose and launch.rank == 0:
        logger.info(
            "initialised %s process group of %d ranks (launched by %s)", backend, launch.world_size, launch.source
        )
