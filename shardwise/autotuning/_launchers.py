"""The launcher each experiment starts with: ``shardwise run`` (the default), or the
``torchrun`` / ``accelerate launch`` line the user put after ``--autotuning tune|run``.

[Note: autotuning launchers]
``shardwise run --autotuning tune torchrun --nproc_per_node 2 train.py --deepspeed ds.json``
tunes a script the user starts with torchrun: every experiment (and the final run) is
``torchrun --nproc_per_node 2 train.py --deepspeed <the experiment's config>``, run as
``python -m torch.distributed.run`` with the tuner's interpreter; ``accelerate launch
--num_processes 2 train.py ...`` likewise (``python -m accelerate.commands.launch``). The
launcher's own parser splits its flags from the script's, and its process count (and
machine count) is the world the space is built for. Plain numbers are required there:
torchrun's ``--nproc_per_node auto`` or an elastic ``--nnodes 1:4`` leave the world size
open, and are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.autotuning._errors import AutotuningError

FOREIGN = ("torchrun", "accelerate")
"""The first tokens after ``--autotuning tune|run`` that name another launcher."""


@dataclass(frozen=True, kw_only=True)
class LauncherLine:
    """A ``torchrun ...`` / ``accelerate launch ...`` line, split."""

    launcher: str
    """``torchrun`` or ``accelerate``."""
    launcher_args: tuple[str, ...]
    """The launcher's flags (before the script)."""
    script: str
    script_args: tuple[str, ...]
    num_nodes: int
    ranks_per_node: int


def _count(flag: str, value, launcher: str) -> int:
    text = str(value)
    low, colon, high = text.partition(":")
    if colon and low == high:  # torchrun's --nnodes default "1:1"
        text = low
    if not text.isdigit() or int(text) < 1:
        raise AutotuningError(
            f"{launcher} {flag} {text}: the tuner builds its search for a fixed number of ranks; "
            f"give {flag} a positive number"
        )
    return int(text)


def _split(tokens: list[str], parsed, launcher: str) -> LauncherLine:
    script_args = list(parsed.training_script_args)
    flags = tokens[: len(tokens) - len(script_args) - 1]
    if launcher == "torchrun":
        nodes, ranks = (
            _count("--nnodes", parsed.nnodes, launcher),
            _count("--nproc_per_node", parsed.nproc_per_node, launcher),
        )
    else:
        if parsed.num_processes is None:
            raise AutotuningError(
                "accelerate launch without --num_processes: the tuner needs the number of ranks on the "
                "command line (it does not read accelerate's config file for it); add --num_processes N"
            )
        nodes = _count("--num_machines", parsed.num_machines or 1, launcher)
        ranks = _count("--num_processes", parsed.num_processes, launcher) // nodes
    return LauncherLine(
        launcher=launcher,
        launcher_args=tuple(flags),
        script=parsed.training_script,
        script_args=tuple(script_args),
        num_nodes=nodes,
        ranks_per_node=ranks,
    )


def parse_launcher_line(first: str, rest: list[str]) -> LauncherLine:
    """Split ``first rest...`` (``torchrun ...`` or ``accelerate launch ...``) with the
    launcher's own parser (see [Note: autotuning launchers]).

    Raises:
        AutotuningError: a launcher line without a script, an ``accelerate`` subcommand
            other than ``launch``, or a rank count that is not a plain number (named).
    """
    if first == "torchrun":
        from torch.distributed.run import get_args_parser as parser
    else:
        if not rest or rest[0] != "launch":
            raise AutotuningError(f"'accelerate {' '.join(rest[:1])}': the tuner starts 'accelerate launch ...' lines")
        rest = rest[1:]
        try:
            from accelerate.commands.launch import launch_command_parser as parser
        except ImportError:
            raise AutotuningError(
                "'accelerate launch' lines need the accelerate package: pip install accelerate"
            ) from None
    try:
        parsed = parser().parse_args(rest)
    except SystemExit:
        raise AutotuningError(f"cannot read the {first} line {' '.join([first, *rest])!r} (see above)") from None
    return _split(rest, parsed, first)


def launcher_head(launcher: str) -> tuple[str, ...]:
    """The words a user types to start ``launcher`` (``cmd.txt`` shows them)."""
    return {"shardwise": ("shardwise", "run"), "torchrun": ("torchrun",), "accelerate": ("accelerate", "launch")}[
        launcher
    ]


def launcher_module(launcher: str) -> tuple[str, ...]:
    """``python -m`` arguments that start ``launcher`` with the tuner's interpreter."""
    return {
        "shardwise": ("shardwise.cli", "run"),
        "torchrun": ("torch.distributed.run",),
        "accelerate": ("accelerate.commands.launch",),
    }[launcher]


def is_foreign(script: str) -> bool:
    """Whether the "script" of ``shardwise run --autotuning ...`` names another launcher."""
    return script in FOREIGN


def reject_mixed_flags(launcher_args: list[str], launcher: str) -> None:
    """``shardwise run`` flags before a ``torchrun``/``accelerate`` line are refused: the
    experiments are started with that launcher's flags only."""
    if launcher_args:
        raise AutotuningError(
            f"shardwise run flags {' '.join(launcher_args)!r} before a {launcher} line: the experiments are "
            f"started with {launcher}'s flags only; give the ranks there (or drop '{launcher}' to use shardwise run)"
        )
