"""Who may open the driver's socket (issue 51). By default it is 0600 and root's, as a driver in
upstream's manifests makes its own: a sidecar must then run as root, which is why kubeloop's image
runs as root unless the pod says otherwise. With --socket-group the driver gives the socket to that
group (0660), and kubeloop's own manifests run the sidecars that need nothing else as 65532."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Driver, require_root

NONROOT = 65532


def connect_as(uid: int, gid: int, path: Path) -> int:
    """0 when a process of this user and group (and no other) can connect to the socket, else
    the errno its connect(2) fails with."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(str(path))
            code = 0
        except OSError as exc:
            code = exc.errno or 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def work() -> Iterator[Path]:
    """A directory every user may enter (pytest's own are root's 0700), gone afterwards."""
    require_root()
    path = Path(tempfile.mkdtemp(prefix="sock", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_the_socket_is_roots_alone_by_default(work: Path) -> None:
    driver = Driver(work, "node", "node-s").start()
    try:
        st = os.stat(driver.socket)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
        assert connect_as(NONROOT, NONROOT, driver.socket) == errno.EACCES
        assert connect_as(0, 0, driver.socket) == 0
    finally:
        driver.stop()


def test_socket_group_lets_that_group_in_and_no_one_else(work: Path) -> None:
    driver = Driver(work, "node", "node-s", extra=[f"--socket-group={NONROOT}"]).start()
    try:
        st = os.stat(driver.socket)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o660, 0, NONROOT)
        assert connect_as(NONROOT, NONROOT, driver.socket) == 0
        assert connect_as(NONROOT + 1, NONROOT + 1, driver.socket) == errno.EACCES
    finally:
        driver.stop()
