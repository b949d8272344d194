"""Child processes of the stack: start in their own process group with the log in a file, stop the
whole group (SIGTERM, then SIGKILL after a timeout), report an unexpected exit loudly, and probe
health endpoints and ports."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import signal
import socket
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from controller_runtime.logs import get_logger

log = get_logger("stack")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: the kernel SIGKILLs the child if the launcher dies
    without cleaning up (SIGKILL, crash, a second Ctrl-C), so no orphan keeps a port or etcd's lock."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


ExitCallback = Callable[["ManagedProcess", int], None]


def tail(path: Path, lines: int = 20) -> str:
    """The last lines of a log file, for error messages that should say why a process died."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


@dataclass
class ManagedProcess:
    """One child process. `on_unexpected_exit` fires when it exits without `stop()` being called."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    on_unexpected_exit: ExitCallback | None = None
    _proc: asyncio.subprocess.Process | None = field(default=None, repr=False)
    _watcher: asyncio.Task[None] | None = field(default=None, repr=False)
    _stopping: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._stopping = False
        # The log is appended to so a restart (restart_apiserver) keeps the earlier run's lines.
        with self.log_path.open("ab") as logf:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            logf.write(f"---- {stamp} kubeloop starts: {' '.join(self.argv)}\n".encode())
            logf.flush()
            # start_new_session: the child leads its own process group, so stop() can signal the
            # child and anything it spawned in one go, and a Ctrl-C in the terminal reaches only the
            # launcher, which then stops the components in order.
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logf,
                stderr=asyncio.subprocess.STDOUT,
                env=dict(self.env) if self.env is not None else None,
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        log.debug("started", component=self.name, pid=self._proc.pid, log=str(self.log_path))
        self._watcher = asyncio.create_task(self._watch(self._proc), name=f"watch-{self.name}")

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if not self._stopping and self.on_unexpected_exit is not None:
            self.on_unexpected_exit(self, code)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # pid reused by someone else's group: nothing of ours is left
            pass

    async def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM to the process group, SIGKILL after `timeout`; returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        self._stopping = True
        if proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                log.warning("did not stop in time, killing", component=self.name, timeout=f"{timeout}s")
                self._signal_group(signal.SIGKILL)
                await proc.wait()
        # Anything the child forked and left behind in its group goes too.
        self._signal_group(signal.SIGKILL)
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        return proc.returncode


class PortInUseError(RuntimeError):
    pass


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    # SO_REUSEADDR as the Go servers set it: only a listener (not TIME_WAIT leftovers) blocks a port.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def check_ports_free(ports: Mapping[str, int], host: str = "127.0.0.1") -> None:
    """Raises PortInUseError naming the port and the component for the first taken or repeated port."""
    seen: dict[int, str] = {}
    for what, port in ports.items():
        if port in seen:
            raise PortInUseError(f"port {port} is configured twice: for {seen[port]} and for {what}")
        seen[port] = what
        if not port_is_free(port, host):
            raise PortInUseError(
                f"port {port} on {host}, needed for {what}, is already in use; stop whatever listens "
                f"there (`ss -ltnp 'sport = :{port}'` shows it) or choose another port with the flags"
            )


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports the kernel considers free right now (for tests)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class UnhealthyError(RuntimeError):
    pass


async def wait_healthy(
    proc: ManagedProcess,
    url: str,
    *,
    ssl_context: ssl.SSLContext | None = None,
    timeout: float = 60.0,
    interval: float = 0.1,
) -> float:
    """Polls `url` until it answers 200; returns the seconds since the call. Fails early, with the
    end of the process's log, if the process exits first."""
    start = time.monotonic()
    last = "no answer yet"
    connector = aiohttp.TCPConnector(ssl=ssl_context if ssl_context is not None else False)
    async with aiohttp.ClientSession(connector=connector) as session:
        while True:
            if not proc.running:
                raise UnhealthyError(
                    f"{proc.name} exited with code {proc.returncode} before it became healthy; "
                    f"end of {proc.log_path}:\n{tail(proc.log_path)}"
                )
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    body = await resp.text()
                    if resp.status == 200:
                        return time.monotonic() - start
                    last = f"HTTP {resp.status}: {body.strip()[:500]}"
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() - start > timeout:
                raise UnhealthyError(
                    f"{proc.name} not healthy at {url} after {timeout:.0f}s (last: {last}); "
                    f"see {proc.log_path}:\n{tail(proc.log_path)}"
                )
            await asyncio.sleep(interval)


def client_ssl_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None and key is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx
