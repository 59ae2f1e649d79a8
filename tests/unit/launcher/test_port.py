"""The rendezvous port: free on one machine, DeepSpeed's 29500 across machines, a busy one
named (see [Note: choosing the master port])."""

import socket

import pytest

from shardwise.launcher import build_parser
from shardwise.launcher._port import DEFAULT_MASTER_PORT, PortInUseError, master_port, port_in_use


@pytest.fixture
def busy_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_listening_port_is_in_use_and_a_closed_one_is_not(busy_port):
    assert port_in_use(busy_port) is True
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    assert port_in_use(closed) is False


def test_one_machine_without_a_port_gets_a_free_one_each_time():
    ports = {master_port(None, one_machine=True, store_here=True) for _ in range(3)}
    assert DEFAULT_MASTER_PORT not in ports
    assert not any(port_in_use(port) for port in ports)


def test_several_machines_keep_deepspeeds_default():
    assert DEFAULT_MASTER_PORT == 29500
    assert master_port(None, one_machine=False, store_here=False) == 29500
    assert build_parser().parse_args(["train.py"]).master_port is None


def test_a_busy_port_is_an_error_naming_it_where_the_store_opens(busy_port):
    with pytest.raises(
        PortInUseError, match=f"--master_port {busy_port} is already in use on this machine.*leave --master_port out"
    ) as caught:
        master_port(busy_port, one_machine=True, store_here=True)
    assert caught.value.port == busy_port
    with pytest.raises(PortInUseError, match="give every node the same free --master_port"):
        master_port(busy_port, one_machine=False, store_here=True)
    assert master_port(busy_port, one_machine=False, store_here=False) == busy_port
