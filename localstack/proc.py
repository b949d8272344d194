"""Child processes of the stack: start in their own process group with the log in a file, stop the
whole group (SIGTERM, then SIGKILL after a timeout), report an unexpected exit loudly or restart the
process with exponential backoff (a RestartPolicy, as a Deployment's pod or compose's
`restart: unless-stopped`), and probe health endpoints and ports."""

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

from controller_runtime.clock import SYSTEM_CLOCK, Clock
from controller_runtime.logs import get_logger

log = get_logger("stack")

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Runs in the child between fork and exec: the kernel sends the child `sig` if its parent dies
    without cleaning up (SIGKILL, crash, a second Ctrl-C), so no orphan keeps a port or etcd's lock.
    The launcher's components get SIGKILL; a launcher started by a test bench gets SIGTERM, which
    it answers with its ordered stop (unmounting what its node agents mounted)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


ExitCallback = Callable[["ManagedProcess", int], None]


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a crashed process after `initial` seconds, the delay multiplied by `factor` per
    further crash up to `cap`; a process that stayed up `reset_after` seconds starts again from
    `initial`. The defaults are kubelet's CrashLoopBackOff shape with a shorter cap (30 s, not 5 min):
    on a laptop a component should be back quickly once its cause is gone."""

    initial: float = 1.0
    factor: float = 2.0
    cap: float = 30.0
    reset_after: float = 60.0


@dataclass
class RestartBackoff:
    """The backoff state of one supervised process; pure, given the times, so a test drives it
    with a fake clock."""

    policy: RestartPolicy
    attempt: int = 0  # crashes in the current series (reset after a long enough run)
    total: int = 0  # restarts since the stack started
    started_at: float | None = None

    def started(self, now: float) -> None:
        self.started_at = now

    def delay(self, attempt: int) -> float:
        """The wait before restart number `attempt` (1-based) of a series."""
        return float(min(self.policy.cap, self.policy.initial * self.policy.factor ** (attempt - 1)))

    def crashed(self, now: float) -> tuple[int, float]:
        """Records a crash at `now`; returns (attempt in the series, seconds to wait before restarting)."""
        if self.started_at is not None and now - self.started_at >= self.policy.reset_after:
            self.attempt = 0
        self.attempt += 1
        self.total += 1
        self.started_at = None
        return self.attempt, self.delay(self.attempt)

    def next_delay(self) -> float:
        """The wait the next crash would get if it came before `reset_after`."""
        return self.delay(self.attempt + 1)


@dataclass(frozen=True)
class RestartEvent:
    """One supervised restart, given to the `on_restart` callback twice: when the crash is seen
    (`restarted` False, `backoff` the wait before the restart) and once the new process runs
    (`restarted` True, `pid` the new one, `backoff` the wait a further crash would get)."""

    name: str
    exit_code: int
    attempt: int
    restarts: int
    backoff: float
    restarted: bool
    pid: int | None


RestartCallback = Callable[["ManagedProcess", RestartEvent], None]


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
    """One child process. When it exits without `stop()` being called, it is restarted under
    `restart` (and `on_restart` told) if a policy is given, else `on_unexpected_exit` fires."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    on_unexpected_exit: ExitCallback | None = None
    restart: RestartPolicy | None = None
    on_restart: RestartCallback | None = None
    clock: Clock = field(default=SYSTEM_CLOCK, repr=False)
    last_exit_code: int | None = None
    _proc: asyncio.subprocess.Process | None = field(default=None, repr=False)
    _watcher: asyncio.Task[None] | None = field(default=None, repr=False)
    _stopping: bool = field(default=False, repr=False)
    _backoff: RestartBackoff | None = field(default=None, repr=False)
    _waiting: bool = field(default=False, repr=False)  # in the backoff sleep: cancellable
    _spawning: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def restarts(self) -> int:
        """How often the supervisor restarted it after a crash (0 without a restart policy)."""
        return self._backoff.total if self._backoff is not None else 0

    async def start(self) -> None:
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self._stopping = False
        if self.restart is not None and self._backoff is None:
            self._backoff = RestartBackoff(self.restart)
        await self._spawn()
        self._watcher = asyncio.create_task(self._watch(), name=f"watch-{self.name}")

    async def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
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
                preexec_fn=die_with_parent,
            )
        if self._backoff is not None:
            self._backoff.started(self.clock.monotonic())
        log.debug("started", component=self.name, pid=self._proc.pid, log=str(self.log_path))

    async def _watch(self) -> None:
        while True:
            proc = self._proc
            assert proc is not None
            code = await proc.wait()
            self.last_exit_code = code
            if self._stopping:
                return
            if self._backoff is None:
                if self.on_unexpected_exit is not None:
                    self.on_unexpected_exit(self, code)
                return
            attempt, delay = self._backoff.crashed(self.clock.monotonic())
            self._notify(RestartEvent(self.name, code, attempt, self._backoff.total, delay, False, None))
            self._waiting = True
            try:
                await self.clock.sleep(delay)
            finally:
                self._waiting = False
            if self._stopping:
                return
            # Shielded: stop() must never cancel a half-made child it would then not know to kill;
            # it waits for the spawn instead and stops what it made.
            self._spawning = asyncio.ensure_future(self._spawn())
            try:
                await asyncio.shield(self._spawning)
            finally:
                self._spawning = None
            next_delay = self._backoff.next_delay()
            self._notify(
                RestartEvent(self.name, code, attempt, self._backoff.total, next_delay, True, self.pid)
            )

    def _notify(self, event: RestartEvent) -> None:
        if event.restarted:
            log.warning(
                f"restarted {event.name} (exit code {event.exit_code}), attempt {event.attempt}, "
                f"next backoff {event.backoff:g}s",
                component=event.name,
                exit_code=event.exit_code,
                attempt=event.attempt,
                restarts=event.restarts,
                next_backoff=f"{event.backoff:g}s",
                pid=event.pid,
            )
        else:
            log.error(
                f"{event.name} exited with code {event.exit_code}; restarting in {event.backoff:g}s",
                component=event.name,
                exit_code=event.exit_code,
                attempt=event.attempt,
                backoff=f"{event.backoff:g}s",
                log=str(self.log_path),
            )
        if self.on_restart is not None:
            self.on_restart(self, event)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # pid reused by someone else's group: nothing of ours is left
            pass

    def disarm(self) -> None:
        """From now on an exit is neither restarted nor reported: the stack is going down, and a
        process that dies because one stopped before it must not come back."""
        self._stopping = True

    async def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM to the process group, SIGKILL after `timeout`; returns the exit code. A pending
        supervised restart is called off; one being spawned right now is waited for, then stopped."""
        self._stopping = True
        if self._watcher is not None and self._waiting:
            self._watcher.cancel()
        spawning = self._spawning
        if spawning is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(spawning)
        proc = self._proc
        if proc is None:
            return None
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


# Test servers listen on ports from here up to the kernel's ephemeral range.
PORT_FLOOR = 20000


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (and `bind(0)`)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def listen_port_candidates() -> list[int]:
    """Ports for test servers, in a per-process order: below the ephemeral range, because a port
    in it that is free when checked can become the local end of any outgoing connection (to etcd,
    to the apiserver) before the server binds it. An ephemeral range starting too low leaves
    nothing below: then the range above it, or anything."""
    low, high = ephemeral_range()
    if low - PORT_FLOOR >= 1000:
        ports = list(range(PORT_FLOOR, low))
    elif 65535 - high >= 1000:
        ports = list(range(high + 1, 65536))
    else:
        ports = list(range(PORT_FLOOR, 65536))
    start = os.getpid() * 37 % len(ports)
    return ports[start:] + ports[:start]


_handed_out: set[int] = set()


def free_ports(count: int, host: str = "127.0.0.1", *, consecutive: bool = False) -> list[int]:
    """`count` distinct ports that are free right now, outside the kernel's ephemeral range (see
    listen_port_candidates) and not handed out before by this process; `consecutive`: a block
    of adjacent ones (a per-node component's instance i listens on port + i)."""
    candidates = listen_port_candidates()
    found: list[int] = []
    for port in candidates:
        block = range(port, port + count) if consecutive else range(port, port + 1)
        if any(p in _handed_out or p > 65535 for p in block):
            continue
        if all(port_is_free(p, host) for p in block):
            found.extend(block)
            _handed_out.update(block)
            if len(found) >= count:
                return found[:count]
    raise RuntimeError(f"no {count} free ports on {host}")


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
