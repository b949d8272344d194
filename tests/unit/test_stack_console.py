"""The launcher's console going away (localstack/console.py) and how `down` finds the running
launcher (localstack.controlplane.running_stack_pid)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import signal
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from localstack.console import ConsoleStream
from localstack.controlplane import StackLockedError, running_stack_pid
from localstack.main import _Launcher


def test_a_write_to_a_pipe_without_reader_is_dropped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    read, write = os.pipe()
    stream = ConsoleStream(write, "<stdout>")
    try:
        print("kubeloop: starting", file=stream, flush=True)
        assert os.read(read, 100) == b"kubeloop: starting\n"
        os.close(read)  # the `tee` of `make up | tee` has ended
        with caplog.at_level(logging.INFO):
            print("kubeloop: stopping the stack", file=stream, flush=True)
            print("kubeloop: stopped", file=stream, flush=True)
    finally:
        os.close(write)
    assert isinstance(stream.lost, BrokenPipeError)
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert messages[0][0] == "WARNING" and "the console's <stdout> is gone" in messages[0][1]
    dropped = [getattr(r, "kubeloop_fields", {}).get("text") for r in caplog.records[1:]]
    assert dropped == ["kubeloop: stopping the stack", "kubeloop: stopped"]


def test_a_lost_console_under_its_own_log_handler_drops_the_line() -> None:
    """--verbose: the log also goes to the console's stderr; a line about the lost stream must not
    come back to it without end."""
    read, write = os.pipe()
    os.close(read)
    stream = ConsoleStream(write, "<stderr>")
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        stream.write("!!! pv-controller exited with code 1\n")
    finally:
        root.removeHandler(handler)
        os.close(write)
    assert stream.lost is not None


def _hold(lock: Path, content: str) -> int:
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, content.encode())
    return fd


def test_running_stack_pid_is_the_lock_holders(tmp_path: Path) -> None:
    assert running_stack_pid(tmp_path) is None, "no lock file: no stack"
    fd = _hold(tmp_path / "stack.lock", "4242\n")
    try:
        assert running_stack_pid(tmp_path) == 4242
    finally:
        os.close(fd)
    assert running_stack_pid(tmp_path) is None, "a pid in a lock nobody holds: a stack that is gone"


def test_a_held_lock_that_names_no_process_is_an_error(tmp_path: Path) -> None:
    fd = _hold(tmp_path / "stack.lock", "")
    try:
        with pytest.raises(StackLockedError, match="names no process"):
            running_stack_pid(tmp_path, settle=0.2)
    finally:
        os.close(fd)


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "no-pidfd"])
def test_down_stops_its_launcher_with_or_without_pidfds(monkeypatch: pytest.MonkeyPatch, pidfd: bool) -> None:
    """Where the kernel has no pidfd_open (before 5.3) or a seccomp profile refuses it, `down` names
    the launcher by pid and start time instead: it still signals it and sees it exit."""
    if not pidfd:

        def refused(pid: int, flags: int = 0) -> int:
            raise OSError(errno.ENOSYS, "Function not implemented")

        monkeypatch.setattr(os, "pidfd_open", refused)
    child = subprocess.Popen(["sleep", "60"])
    try:
        launcher = _Launcher.of(child.pid)
        assert launcher is not None and (launcher.pidfd is not None) == pidfd
        assert not launcher.wait(0.2)  # still running
        launcher.terminate()
        assert launcher.wait(10)  # exited (a zombie until reaped counts as exited)
        launcher.close()
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGTERM
    assert _Launcher.of(child.pid) is None  # reaped: nothing left to signal or wait for


def test_a_full_non_blocking_console_is_waited_for_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """EAGAIN from a terminal another program set O_NONBLOCK on means "full for a moment"."""
    full = threading.Event()  # the write found the pipe full and waits for room

    def waiting_for_room(*args: Any) -> Any:
        full.set()
        return select.select(*args)

    monkeypatch.setattr("localstack.console.select", SimpleNamespace(select=waiting_for_room))
    read, write = os.pipe()
    os.set_blocking(write, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(write, b"x" * 65536)
    drained = bytearray()

    def drain() -> None:
        assert full.wait(10), "the write never waited for room"  # it found the pipe full first
        while not drained.endswith(b"still here\n"):
            drained.extend(os.read(read, 1 << 20))

    reader = threading.Thread(target=drain)
    reader.start()
    stream = ConsoleStream(write, "<stdout>")
    try:
        print("still here", file=stream, flush=True)
        reader.join(10)
    finally:
        os.close(write)
        os.close(read)
    assert stream.lost is None
    assert drained.endswith(b"still here\n")
