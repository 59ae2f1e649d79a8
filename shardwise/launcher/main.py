"""Argument handling of ``shardwise run`` (DeepSpeed's launcher flags, same meanings)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from shardwise.launcher._port import DEFAULT_MASTER_PORT, PortInUseError, master_port
from shardwise.launcher.hostfile import HostfileError, parse_hostfile, select_resources
from shardwise.launcher.node import JobSpec, LaunchError, add_rank_flags, rank_options, run_node
from shardwise.launcher.runner import multinode_commands, run_multinode

DEFAULT_HOSTFILE = "/job/hostfile"
LOCAL_NAMES = {"localhost", "127.0.0.1", os.uname().nodename}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="shardwise run")
    parser.description = (
        "Start SCRIPT on every rank: N processes on this machine, or on every "
        "host of a hostfile. Without a GPU the ranks are CPU processes (gloo)."
    )
    add = parser.add_argument
    add(
        "-H",
        "--hostfile",
        default=None,
        help=f"file of 'hostname slots=N' lines (default {DEFAULT_HOSTFILE} if it exists)",
    )
    add("-i", "--include", default="", help="only these hosts/slots, e.g. worker-0:0,1@worker-1")
    add("-e", "--exclude", default="", help="all but these hosts/slots (same syntax as --include)")
    add(
        "--num_nodes",
        type=int,
        default=-1,
        help="use the first N hosts (or, with --node_rank, the number of machines of a manually started job)",
    )
    add(
        "--node_rank",
        type=int,
        default=-1,
        help="this machine's rank in a manually started multi-node job (run the command on every machine)",
    )
    add("--num_gpus", "--num_accelerators", type=int, default=-1, dest="num_gpus", help="devices (ranks) per node")
    add("--nproc", type=int, default=-1, help="ranks per node on CPU (default: GPU count, or 1)")
    add("--master_addr", default="", help="address of rank 0's machine (default: first host)")
    add(
        "--master_port",
        type=int,
        default=None,
        help=f"port of the rendezvous store (default: a free port when the job runs on this machine "
        f"only, {DEFAULT_MASTER_PORT} across machines)",
    )
    add(
        "--launcher",
        default="ssh",
        choices=["ssh", "pdsh", "slurm", "mpi", "local"],
        help="how to start the per-node launchers on other machines",
    )
    add("--launcher_args", default="", help="extra arguments for pdsh / srun / mpirun")
    add("--force_multi", action="store_true", help="use the multi-node path even for one host")
    add_rank_flags(add)
    add(
        "--save_pid",
        action="store_true",
        help="write this launcher's process id to /tmp/<pid>.deepspeed while the job runs",
    )
    add("--ssh_port", type=int, default=None, help="the ssh port of the other hosts (--launcher ssh)")
    add("--no_ssh_check", action="store_true", help="accepted for DeepSpeed's scripts: no ssh check is ever run")
    add(
        "--no_ssh",
        action="store_true",
        help="run this same command on every machine of the hostfile, each with its --node_rank, instead of "
        "starting the others over ssh",
    )
    add(
        "--autotuning",
        default="",
        choices=["", "tune", "run"],
        help="tune: find the fastest configuration that fits (the script's --deepspeed config has the "
        "'autotuning' section), writing it to results_dir; run: tune, then train with it. A script "
        "started with torchrun or accelerate: put that line in the script's place "
        "(shardwise run --autotuning tune torchrun --nproc_per_node 2 train.py --deepspeed ds.json)",
    )
    add("script", help="the training script")
    add("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _cuda_count() -> int:
    """GPUs torch would see here; 0 without asking torch when no GPU device file exists
    (importing torch costs the launcher seconds of CPU per job on a machine without one)."""
    if not any(Path("/dev").glob("nvidia[0-9]*")) and not any(Path(p).exists() for p in ("/dev/kfd", "/dev/dxg")):
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable CUDA build: count no GPUs
        return 0


def _hosts(args) -> dict[str, int] | None:
    if args.hostfile is not None:
        return parse_hostfile(args.hostfile)
    if Path(DEFAULT_HOSTFILE).is_file():
        return parse_hostfile(DEFAULT_HOSTFILE)
    return None


def _local_ranks(args, default: int) -> int:
    for value, flag in ((args.nproc, "--nproc"), (args.num_gpus, "--num_gpus")):
        if value == 0 or value < -1:
            raise HostfileError(f"{flag} must be a positive number of ranks, got {value}")
    if args.nproc > 0:
        return args.nproc
    if args.num_gpus > 0:
        return args.num_gpus
    return default


def _run_here(spec: JobSpec, args) -> int:
    """Run the whole job on this machine (its rendezvous store opens here)."""
    spec.master_addr = args.master_addr or "127.0.0.1"
    spec.master_port = master_port(args.master_port, one_machine=True, store_here=True)
    return run_node(spec)


def run(args) -> int:
    """Resolve resources and start the job; returns the exit code."""
    if not (args.module or args.no_python) and not Path(args.script).is_file():
        raise HostfileError(f"training script {args.script!r} does not exist")
    cuda = _cuda_count()
    hosts = _hosts(args) if args.launcher != "local" else None
    spec = JobSpec(
        script=args.script,
        script_args=list(args.script_args),
        nproc_per_node=1,
        **rank_options(args),
    )
    if args.no_ssh:
        return _run_without_ssh(spec, args, cuda)
    if args.node_rank >= 0:  # one machine's part of a job started by hand on every machine
        if args.num_nodes < 1 or args.node_rank >= args.num_nodes:
            raise HostfileError(f"--node_rank {args.node_rank} needs --num_nodes greater than it")
        if not args.master_addr:
            raise HostfileError("--node_rank needs --master_addr (the address of node 0)")
        spec.num_nodes, spec.node_rank, spec.master_addr = args.num_nodes, args.node_rank, args.master_addr
        spec.nproc_per_node = _local_ranks(args, cuda or 1)
        store_here = args.node_rank == 0 and args.master_addr in LOCAL_NAMES
        spec.master_port = master_port(args.master_port, one_machine=args.num_nodes == 1, store_here=store_here)
        return run_node(spec)
    if hosts is None:
        if args.include or args.exclude:
            hosts = {"localhost": _local_ranks(args, cuda or 1)}
        else:
            spec.nproc_per_node = _local_ranks(args, cuda or 1)
            return _run_here(spec, args)
    resources = select_resources(
        hosts, include=args.include, exclude=args.exclude, num_nodes=args.num_nodes, num_slots=args.num_gpus
    )
    if len(resources) == 1 and not args.force_multi and next(iter(resources)) in LOCAL_NAMES:
        slots = next(iter(resources.values()))
        if cuda:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        spec.nproc_per_node = args.nproc if args.nproc > 0 else len(slots)
        return _run_here(spec, args)
    sizes = {len(s) for s in resources.values()}
    if len(sizes) != 1:
        raise HostfileError(
            f"every host must run the same number of ranks; the selection gives "
            f"{ {h: len(s) for h, s in resources.items()} }"
        )
    spec.num_nodes = len(resources)
    spec.nproc_per_node = args.nproc if args.nproc > 0 else sizes.pop()
    spec.master_addr = args.master_addr or next(iter(resources))
    spec.master_port = master_port(args.master_port, one_machine=False, store_here=False)
    ssh = shlex.split(os.environ.get("SHARDWISE_SSH", "ssh -o StrictHostKeyChecking=no -o BatchMode=yes"))
    if args.ssh_port is not None:
        if args.launcher != "ssh":
            raise HostfileError(
                f"--ssh_port works with --launcher ssh; give {args.launcher} its port in --launcher_args"
            )
        ssh += ["-p", str(args.ssh_port)]
    commands = multinode_commands(spec, resources, args.launcher, ssh=ssh, cuda=cuda > 0)
    extra = shlex.split(args.launcher_args)
    if extra and args.launcher != "ssh":
        commands = [[cmd[0], *extra, *cmd[1:]] for cmd in commands]
    return run_multinode(commands)


def _run_without_ssh(spec: JobSpec, args, cuda: int) -> int:
    """DeepSpeed's ``--no_ssh``: every machine of the hostfile runs the same command with its
    own ``--node_rank`` (its place among the selected hosts) and starts its own ranks; the
    master is the first host unless ``--master_addr`` says otherwise."""
    hosts = _hosts(args)
    if hosts is None:
        raise HostfileError(f"--no_ssh needs a hostfile naming every machine (--hostfile, or {DEFAULT_HOSTFILE})")
    resources = select_resources(
        hosts, include=args.include, exclude=args.exclude, num_nodes=args.num_nodes, num_slots=args.num_gpus
    )
    names = list(resources)
    if not 0 <= args.node_rank < len(names):
        raise HostfileError(
            f"--no_ssh needs --node_rank, this machine's place among the {len(names)} hosts {names} "
            f"(0 to {len(names) - 1}); got {args.node_rank}"
        )
    sizes = {len(slots) for slots in resources.values()}
    if len(sizes) != 1 and args.nproc <= 0:
        raise HostfileError(f"every host must run the same number of ranks; the selection gives {resources}")
    spec.num_nodes, spec.node_rank = len(names), args.node_rank
    spec.nproc_per_node = args.nproc if args.nproc > 0 else sizes.pop()
    spec.master_addr = args.master_addr or names[0]
    if cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, resources[names[args.node_rank]]))
    store_here = args.node_rank == 0 and spec.master_addr in LOCAL_NAMES
    spec.master_port = master_port(args.master_port, one_machine=len(names) == 1, store_here=store_here)
    return run_node(spec)


def planned_ranks(args) -> tuple[int, int]:
    """(machines, ranks per machine) the flags ``args`` start a job on, as :func:`run`
    resolves them."""
    cuda = _cuda_count()
    if args.node_rank >= 0:
        return args.num_nodes, _local_ranks(args, cuda or 1)
    hosts = _hosts(args) if args.launcher != "local" else None
    if hosts is None:
        if not (args.include or args.exclude):
            return 1, _local_ranks(args, cuda or 1)
        hosts = {"localhost": _local_ranks(args, cuda or 1)}
    resources = select_resources(
        hosts, include=args.include, exclude=args.exclude, num_nodes=args.num_nodes, num_slots=args.num_gpus
    )
    slots = min(len(s) for s in resources.values())
    return len(resources), args.nproc if args.nproc > 0 else slots


def _launcher_flags(argv: list[str], args) -> list[str]:
    """The launcher flags of ``argv`` (everything before the script), ``--autotuning`` left out."""
    flags = argv[: len(argv) - len(args.script_args) - 1]
    out, skip = [], False
    for token in flags:
        if skip:
            skip = False
        elif token == "--autotuning":
            skip = True
        elif not token.startswith("--autotuning="):
            out.append(token)
    return out


def _autotune(argv: list[str], args) -> int:
    from shardwise.autotuning import AutotuningError, Resources, autotune
    from shardwise.autotuning._launchers import is_foreign, parse_launcher_line, reject_mixed_flags
    from shardwise.config import ConfigError

    try:
        if args.module or args.no_python:
            raise HostfileError("--autotuning tunes a Python script: give its path instead of --module / --no_python")
        if args.no_ssh:
            raise HostfileError("--autotuning starts every experiment itself: run it on one machine, without --no_ssh")
        if is_foreign(args.script):  # shardwise run --autotuning tune torchrun|accelerate launch ...
            line = parse_launcher_line(args.script, list(args.script_args))
            reject_mixed_flags(_launcher_flags(argv, args), line.launcher)
            launcher, launcher_args, script, script_args = (
                line.launcher,
                line.launcher_args,
                line.script,
                line.script_args,
            )
            nodes, ranks = line.num_nodes, line.ranks_per_node
        else:
            launcher, launcher_args, script, script_args = (
                "shardwise",
                _launcher_flags(argv, args),
                args.script,
                args.script_args,
            )
            nodes, ranks = planned_ranks(args)
        if not Path(script).is_file():
            raise HostfileError(f"training script {script!r} does not exist")
        return autotune(
            args.autotuning,
            launcher_args=list(launcher_args),
            script=script,
            script_args=list(script_args),
            resources=Resources(num_nodes=nodes, ranks_per_node=ranks, on_cpu=_cuda_count() == 0),
            launcher=launcher,
        )
    except (AutotuningError, ConfigError) as exc:
        print(f"shardwise run --autotuning: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    pid_file = Path(f"/tmp/{os.getpid()}.deepspeed") if args.save_pid else None  # DeepSpeed's name
    try:
        if pid_file is not None:
            print(f"launcher pid: {os.getpid()}")
            pid_file.write_text(str(os.getpid()))
        if args.autotuning:
            return _autotune(argv, args)
        return run(args)
    except (HostfileError, PortInUseError, LaunchError) as exc:
        print(f"shardwise run: {exc}", file=sys.stderr)
        return 2
    finally:
        if pid_file is not None:
            pid_file.unlink(missing_ok=True)
