"""Helpers every benchmark shares: percentiles, RSS, tables, JSON results, a throw-away control plane."""

from __future__ import annotations

import asyncio
import compileall
import contextlib
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller_runtime.clock import SYSTEM_CLOCK, Clock, now_rfc3339
from controller_runtime.toolchain import REPO_ROOT, Toolchain
from localstack.controlplane import ControlPlane
from localstack.testing import start_test_control_plane

RESULTS_DIR = REPO_ROOT / "bench" / "results"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample: the smallest value that at
    least q % of the sample does not exceed, so p99 of 100 values is the 99th, not the largest."""
    ordered = sorted(values)
    # Rounded before the ceiling so that 99 % of 100 is 99, whatever the float product's last bit.
    rank = math.ceil(round(q * len(ordered) / 100, 9))
    return ordered[max(1, min(len(ordered), rank)) - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size from /proc (no psutil needed in the measured child)."""
    path = f"/proc/{pid or 'self'}/status"
    for line in Path(path).read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in {path}")


class PeakRss:
    """The highest RSS (MiB) of each of a changing set of named processes, sampled in the
    background while the context is open; `pids` is asked again at every sample, so processes
    started or restarted meanwhile are followed."""

    def __init__(
        self,
        pids: Callable[[], Mapping[str, int | None]],
        interval: float = 0.25,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.peaks: dict[str, float] = {}
        self._pids = pids
        self._interval = interval
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> None:
        for name, pid in self._pids().items():
            if pid is None:
                continue
            with contextlib.suppress(OSError, RuntimeError):  # gone between listing and reading
                self.peaks[name] = max(self.peaks.get(name, 0.0), round(rss_bytes(pid) / 2**20, 1))

    async def _run(self) -> None:
        while True:
            self.sample()
            await self._clock.sleep(self._interval)

    async def __aenter__(self) -> PeakRss:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *_exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sample()


class CpuUse:
    """CPU seconds (user + system) each named process spent while the context was open. Names the
    context did not see start count from zero; the processes must still run when it closes."""

    def __init__(self, pids: Callable[[], Mapping[str, int | None]]) -> None:
        self._pids = pids
        self._start: dict[str, float] = {}
        self.spent: dict[str, float] = {}

    def __enter__(self) -> CpuUse:
        self._start = {name: cpu_seconds(pid) for name, pid in self._pids().items()}
        return self

    def __exit__(self, *_exc: object) -> None:
        self.spent = {
            name: round(cpu_seconds(pid) - self._start.get(name, 0.0), 2)
            for name, pid in self._pids().items()
        }

    def total(self, names: Iterable[str]) -> float:
        return round(sum(self.spent.get(n, 0.0) for n in names), 2)


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def stamped(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """A result document: the benchmark's name, the time and the machine, then `data`."""
    return {
        "benchmark": name,
        "time": now_rfc3339(),
        "machine": {"python": platform.python_version(), "cpus": _cpus()},
        **data,
    }


def write_results(name: str, data: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(stamped(name, data), indent=2) + "\n")
    return path


def kcm_argv(controllers: str, kubeconfig: str, qps: float, burst: int, port: int) -> list[str]:
    """The real kube-controller-manager running only `controllers`, at its defaults but for the
    client QPS, for the side-by-side comparisons."""
    return [
        str(Toolchain.default().binary("kube-controller-manager")),
        f"--controllers={controllers}",
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--kube-api-qps={qps}",
        f"--kube-api-burst={burst}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--profiling=false",
    ]


async def stop_process(proc: asyncio.subprocess.Process, timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout`."""
    if proc.returncode is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()


def _cpus() -> int:
    return os.cpu_count() or 0


@contextlib.asynccontextmanager
async def control_plane(**kwargs: Any) -> AsyncIterator[ControlPlane]:
    with tempfile.TemporaryDirectory(prefix="kubeloop-bench-") as tmp:
        cp = await start_test_control_plane(Path(tmp), **kwargs)
        try:
            yield cp
        finally:
            await cp.stop()


def compile_sources() -> None:
    """Byte-compiles the repository's packages into their __pycache__ directories, as installing
    kubeloop's wheel does. The development environment sets PYTHONDONTWRITEBYTECODE, so without
    this every measured kubeloop process compiled its modules from source at start (about 0.45 s
    of CPU for the external-provisioner), a cost the deployed image does not have. Symlinked
    packages (kubeloop_grpc in a worktree) are left to their own checkout, tests are not measured."""
    for package in sorted(REPO_ROOT.iterdir()):
        if package.name == "tests" or package.is_symlink():
            continue
        if package.is_dir() and (package / "__init__.py").exists():
            compileall.compile_dir(package, quiet=1)


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a live process, from /proc (0 when it is gone)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def start(
    argv: list[str], log: Path, cwd: Path = REPO_ROOT, env: Mapping[str, str] | None = None
) -> asyncio.subprocess.Process:
    """A process in its own session, its output appended to `log`; `env` replaces the environment."""
    return await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdout=log.open("ab"),
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )


@dataclass(frozen=True)
class LogMark:
    """Where a process's log ended before it started: `wait_log` reads only what it wrote since
    (the bench appends every run to one log per component)."""

    path: Path
    offset: int

    @classmethod
    def here(cls, path: Path) -> LogMark:
        return cls(path, path.stat().st_size if path.exists() else 0)


async def wait_log(
    mark: LogMark, marker: str, proc: asyncio.subprocess.Process, timeout: float = 120
) -> float:
    """Waits until the process has logged `marker` since `mark` (its ready line); returns the
    seconds waited. A start-up slowed by a busy machine is waited for rather than measured as part
    of the work that follows."""
    started = time.monotonic()
    needle = marker.encode()
    while True:
        with contextlib.suppress(FileNotFoundError), mark.path.open("rb") as f:
            f.seek(mark.offset)
            if needle in f.read():
                return time.monotonic() - started
        if proc.returncode is not None:
            raise RuntimeError(f"{mark.path.name}: the process exited before logging {marker!r}")
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"{mark.path.name}: no {marker!r} within {timeout:g} s")
        await asyncio.sleep(0.05)


async def wait_socket(path: Path, proc: asyncio.subprocess.Process, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(os.path.exists, path):
        if proc.returncode is not None or time.monotonic() > deadline:
            raise RuntimeError(f"driver did not create {path}")
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # the driver probes ready once its state is reconciled


async def start_controller_driver(
    root: Path, log: Path, http_endpoint: str = ""
) -> tuple[asyncio.subprocess.Process, Path]:
    """kubeloop's CSI driver in controller mode on a pool under `root` (10Ti of --capacity, so the
    pool's free space never limits a benchmark), once its socket is up; returns it and the socket.
    With `http_endpoint` it serves its metrics there (bench.work counts its calls)."""
    socket = root / "csi.sock"
    argv = [
        sys.executable,
        "-m",
        "csi_driver.main",
        "--mode=controller",
        f"--endpoint=unix://{socket}",
        f"--pool-dir={root / 'pool'}",
        f"--state-dir={root / 'state'}",
        "--capacity=10Ti",
        "-v=1",
        *([f"--http-endpoint={http_endpoint}"] if http_endpoint else []),
    ]
    driver = await start(argv, log)
    await wait_socket(socket, driver)
    return driver, socket
