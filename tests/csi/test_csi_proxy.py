"""localstack.csi_proxy, the stand-in for hostpathplugin's proxy mode that the e2e suite's CSI Mock
specs deploy: each client of the unix socket is paired with the oldest connection waiting on the TCP
port, bytes flow both ways, an end on one side ends the other, and SIGTERM removes the socket."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.waits import eventually

from .conftest import REPO
from .processes import free_port


@pytest.fixture
def proxy() -> Iterator[tuple[Path, int]]:
    work = Path(tempfile.mkdtemp(prefix="proxy"))
    sock, port = work / "csi.sock", free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "localstack.csi_proxy", "-v=5", "-nodeid=node-a", f"-endpoint={sock}",
         f"-proxy-endpoint=tcp://127.0.0.1:{port}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        eventually("the proxy's socket", sock.exists, 30)
        yield sock, port
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=20)[0].decode()
        assert proc.returncode == 0, out
        assert not sock.exists(), "the socket is removed on SIGTERM"
        os.rmdir(work)


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        assert chunk, f"end of stream after {data!r}"
        data += chunk
    return data


def test_each_unix_client_is_paired_with_the_oldest_waiting_connection(proxy: tuple[Path, int]) -> None:
    sock, port = proxy
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    first = socket.create_connection(("127.0.0.1", port), timeout=10)
    second = socket.create_connection(("127.0.0.1", port), timeout=10)
    clients = []
    for _ in range(2):
        c = socket.socket(socket.AF_UNIX)
        c.settimeout(10)
        c.connect(str(sock))
        clients.append(c)
    try:
        clients[0].sendall(b"from client 0")
        clients[1].sendall(b"from client 1")
        assert recv_exactly(first, 13) == b"from client 0"
        assert recv_exactly(second, 13) == b"from client 1"
        big = os.urandom(1 << 20)  # more than one chunk, both ways
        second.sendall(big)
        assert recv_exactly(clients[1], len(big)) == big
        clients[0].sendall(big)
        assert recv_exactly(first, len(big)) == big
        # The client going away ends its pair's far side.
        clients[0].close()
        assert first.recv(1) == b""
        # And the far side going away ends the client's.
        second.close()
        assert clients[1].recv(1) == b""
    finally:
        for c in (first, second, *clients):
            c.close()


@pytest.mark.parametrize(
    "args, message",
    [
        (["-endpoint=/tmp/x.sock"], "-proxy-endpoint is required"),
        (["-proxy-endpoint=unix:///tmp/y.sock"], "only tcp://[HOST]:PORT is supported"),
        (["-proxy-endpoint=tcp://:99999"], "the port must be a number 1-65535"),
        (["-no-such-flag"], "no-such-flag"),
    ],
)
def test_a_command_line_it_cannot_serve_is_refused_naming_the_flag(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "localstack.csi_proxy", *args], cwd=REPO, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and message in result.stderr, result.stderr
