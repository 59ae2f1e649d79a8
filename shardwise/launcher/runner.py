"""Start the job: this machine's ranks here, or a per-node launcher on every host over ssh,
pdsh, srun or mpirun.

On this machine ``shardwise run`` starts the ranks itself (``node.run_node``); on other
machines it starts ``python -m shardwise.launcher.node`` with ``--nnodes``/``--node_rank``
and the master's address, as DeepSpeed's launcher starts its per-node launcher. Rank 0
opens the rendezvous store (``init_process_group``'s ``env://``). Within a node, the node
launcher stops every rank as soon as one fails. Across nodes, this module watches the
per-node launchers and stops all of them when one exits with an error.
"""

from __future__ import annotations

import os
import shlex
import subprocess

from shardwise.launcher.environment import NO_LOCAL_RANK_ENV, export_prefix, exports
from shardwise.launcher.node import JobSpec, node_command, wait_all

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
"""DeepSpeed's name for its environment file (read too; see ``environment.ENV_FILES``)."""
NODE_RANK_PLACEHOLDER = {"pdsh": "%n", "slurm": "$SLURM_NODEID", "mpi": "$OMPI_COMM_WORLD_RANK"}
"""How each multi-node launcher tells a node its rank (expanded on the node)."""


def remote_command(
    spec: JobSpec, launcher: str, *, node_rank: str | int, exported: dict[str, str], visible_slots: list[int] | None
) -> str:
    """The shell line a remote node runs: cd, exports, then its node launcher."""
    env = dict(exported)
    if spec.no_local_rank:
        env[NO_LOCAL_RANK_ENV] = "1"
    if visible_slots is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, visible_slots))
    line = " ".join(shlex.quote(part) for part in node_command(spec, node_rank="__RANK__"))
    line = line.replace("__RANK__", str(node_rank))
    return f"cd {shlex.quote(os.getcwd())}; {export_prefix(env)}{line}"


def multinode_commands(
    spec: JobSpec, resources: dict[str, list[int]], launcher: str, *, ssh: list[str], cuda: bool
) -> list[list[str]]:
    """One command per launcher process: per host for ssh, one in total otherwise."""
    exported = exports()
    hosts = list(resources)
    if launcher == "ssh":
        return [
            [
                *ssh,
                host,
                remote_command(
                    spec, launcher, node_rank=rank, exported=exported, visible_slots=resources[host] if cuda else None
                ),
            ]
            for rank, host in enumerate(hosts)
        ]
    line = remote_command(
        spec, launcher, node_rank=NODE_RANK_PLACEHOLDER[launcher], exported=exported, visible_slots=None
    )
    if launcher == "pdsh":
        return [["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), line]]
    if launcher == "slurm":
        return [
            [
                "srun",
                f"--nodes={len(hosts)}",
                "--ntasks-per-node=1",
                f"--nodelist={','.join(hosts)}",
                "bash",
                "-c",
                line,
            ]
        ]
    if launcher == "mpi":
        return [
            [
                "mpirun",
                "-np",
                str(len(hosts)),
                "-H",
                ",".join(f"{h}:1" for h in hosts),
                "--map-by",
                "ppr:1:node",
                "bash",
                "-c",
                line,
            ]
        ]
    raise ValueError(f"unknown launcher {launcher!r}; use ssh, pdsh, slurm, mpi or local")


def run_multinode(commands: list[list[str]]) -> int:
    """Start every node's launcher; if one fails, stop the rest. Returns the exit code."""
    procs = [subprocess.Popen(cmd, start_new_session=True) for cmd in commands]
    return wait_all(procs).code
