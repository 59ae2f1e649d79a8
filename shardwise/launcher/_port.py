"""The rendezvous port of ``shardwise run``.

[Note: choosing the master port]
DeepSpeed's launcher defaults ``--master_port`` to 29500, PyTorch's default. Across
machines that default is what lets every node agree on the port without talking first,
so it stays. On one machine nothing has to be agreed, and a fixed default makes a second
job started on the same host collide with the first: its rank 0 fails to open the
store and the other ranks wait for it. So without ``--master_port`` a job on
one machine takes a port the system reports free, and a port given explicitly for a
store opened here is checked first, failing with an error that names it. Between the
check (or the choice) and rank 0 opening the store another process could still take
the port (the window is the launcher's start-up); a collision then fails as it did
before, which is rare since the system draws a free port from a wide range each time.
"""

from __future__ import annotations

import errno
import socket

DEFAULT_MASTER_PORT = 29500
"""DeepSpeed's and PyTorch's default port, used when the job spans several machines."""


class PortInUseError(RuntimeError):
    """The rendezvous port is taken on this machine; the message names it."""

    def __init__(self, port: int, *, one_machine: bool):
        fix = (
            "leave --master_port out to let the job pick a free port, or give a free one"
            if one_machine
            else "give every node the same free --master_port"
        )
        super().__init__(
            f"--master_port {port} is already in use on this machine (another job's "
            f"rendezvous store, or another program, listens on it); {fix}"
        )
        self.port = port


def free_port() -> int:
    """A TCP port no process on this machine holds now (the system's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def port_in_use(port: int) -> bool:
    """Whether a process on this machine holds TCP ``port`` on any address (IPv4 or IPv6).

    A port left in TIME_WAIT by a finished job counts as free, as it does for the store,
    which binds with ``SO_REUSEADDR`` too.
    """
    for family, address in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((address, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def master_port(requested: int | None, *, one_machine: bool, store_here: bool) -> int:
    """The port of the job's rendezvous store (see [Note: choosing the master port]).

    Args:
        requested: ``--master_port``, or None when it was left out.
        one_machine: the whole job runs on this machine.
        store_here: this machine opens the store (one machine, or node 0 of a job started
            by hand with a local ``--master_addr``); only then can a busy port be seen.

    Raises:
        PortInUseError: the port is taken on this machine and the store opens here.
    """
    if requested is None and one_machine:
        return free_port()
    port = DEFAULT_MASTER_PORT if requested is None else requested
    if store_here and port_in_use(port):
        raise PortInUseError(port, one_machine=one_machine)
    return port
