"""Hostfiles and the --include / --exclude / --num_nodes / --num_gpus selection.

A hostfile lists one machine per line as ``hostname slots=N`` (N devices, or CPU
processes); ``#`` starts a comment and blank lines are ignored. A selection string names
hosts separated by ``@``, each optionally followed by ``:`` and a comma-separated list
of slot indices: ``worker-0:0,1@worker-1`` means slots 0 and 1 of worker-0 and every
slot of worker-1.
"""

from __future__ import annotations

import re
from pathlib import Path

_LINE = re.compile(r"^(?P<host>[^\s=]+)\s+slots\s*=\s*(?P<slots>\d+)$")


class HostfileError(ValueError):
    """A hostfile or host selection is malformed; the message names the line or host."""


def parse_hostfile(path: str | Path) -> dict[str, int]:
    """Read ``hostname slots=N`` lines into an ordered ``{host: slots}``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise HostfileError(f"cannot read hostfile {path}: {exc.strerror}") from None
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if not match:
            raise HostfileError(f"hostfile {path} line {number}: expected 'hostname slots=N', got {raw.strip()!r}")
        host, slots = match["host"], int(match["slots"])
        if host in hosts:
            raise HostfileError(f"hostfile {path} line {number}: host {host!r} is listed twice")
        if slots < 1:
            raise HostfileError(f"hostfile {path} line {number}: {host} must have at least 1 slot")
        hosts[host] = slots
    if not hosts:
        raise HostfileError(f"hostfile {path} lists no hosts; add lines like 'worker-0 slots=8'")
    return hosts


def parse_selection(spec: str) -> dict[str, list[int] | None]:
    """Parse ``host:0,1@host2`` into ``{host: [0, 1], host2: None}`` (None = all slots)."""
    selection: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        part = part.strip()
        if not part:
            raise HostfileError(f"empty host in selection {spec!r}; the syntax is host:0,1@host2")
        host, _, slots = part.partition(":")
        if host in selection:
            raise HostfileError(f"host {host!r} appears twice in selection {spec!r}")
        if not slots:
            selection[host] = None
            continue
        try:
            selection[host] = sorted({int(s) for s in slots.split(",")})
        except ValueError:
            raise HostfileError(f"slots of {host!r} in {spec!r} must be integers like {host}:0,1") from None
    return selection


def select_resources(
    hosts: dict[str, int], *, include: str = "", exclude: str = "", num_nodes: int = -1, num_slots: int = -1
) -> dict[str, list[int]]:
    """The slots to use on each host after --include/--exclude/--num_nodes/--num_gpus."""
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive; use one of them")
    pool = {host: list(range(slots)) for host, slots in hosts.items()}
    chosen = parse_selection(include or exclude) if (include or exclude) else {}
    for host, slots in chosen.items():
        if host not in pool:
            raise HostfileError(
                f"host {host!r} in --{'include' if include else 'exclude'} is not in the "
                f"hostfile (hosts: {', '.join(pool)})"
            )
        bad = [s for s in slots or [] if s >= hosts[host]]
        if bad:
            raise HostfileError(f"{host} has {hosts[host]} slots (0..{hosts[host] - 1}); slot {bad[0]} does not exist")
    if include:
        pool = {host: (slots if slots is not None else pool[host]) for host, slots in chosen.items()}
    elif exclude:
        for host, slots in chosen.items():
            if slots is None:
                del pool[host]
            else:
                pool[host] = [s for s in pool[host] if s not in slots]
        pool = {host: slots for host, slots in pool.items() if slots}
    if num_nodes > 0:
        if num_nodes > len(pool):
            raise HostfileError(f"--num_nodes {num_nodes} but only {len(pool)} host(s) are available")
        pool = dict(list(pool.items())[:num_nodes])
    if num_slots > 0:
        short = [h for h, s in pool.items() if len(s) < num_slots]
        if short:
            raise HostfileError(f"--num_gpus {num_slots} but {short[0]} has only {len(pool[short[0]])} slot(s)")
        pool = {host: slots[:num_slots] for host, slots in pool.items()}
    if not pool:
        raise HostfileError("the host selection leaves no hosts to run on")
    return pool
