"""Test servers' ports come from below the kernel's ephemeral range, where no outgoing connection
can take one between the check and the server's bind."""

from __future__ import annotations

import socket

from localstack import proc


def test_ports_are_distinct_free_and_outside_the_ephemeral_range() -> None:
    low, high = proc.ephemeral_range()
    ports = proc.free_ports(5)
    assert len(set(ports)) == 5
    assert not any(low <= p <= high for p in ports)
    assert all(proc.port_is_free(p) for p in ports)
    assert not set(ports) & set(proc.free_ports(5)), "a port is handed out once per process"


def test_a_block_is_adjacent_and_skips_a_taken_port() -> None:
    first = proc.listen_port_candidates()[0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        try:
            taken.bind(("127.0.0.1", first))
            taken.listen()
        except OSError:
            pass  # already in use by something else: skipped either way
        block = proc.free_ports(3, consecutive=True)
    assert block == [block[0], block[0] + 1, block[0] + 2]
    assert first not in block
