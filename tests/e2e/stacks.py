"""The launcher as a process in the e2e tests: `launch` starts `python -m localstack.main up` as
`make up` would (test ports, no fsync) and waits for its ready line; `RunningStack` is what it
started, `cleanup` stops it and kills whatever mentions its home (`stack_processes`), and
`short_home` is a home shallow enough for the node plugins' unix sockets."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from controller_runtime.toolchain import REPO_ROOT, MissingBinaryError, Toolchain
from localstack.controlplane import Ports
from localstack.proc import free_ports
from localstack.testing import free_stack_ports
from tests.support.waits import eventually

READY_LINE = "kubeloop stack is ready"
# Prometheus of the module's stack: a free port, not the default a developer's `make up` may hold.
PROMETHEUS_TEST_PORT = free_ports(1)[0]
START_TIMEOUT = 240.0  # two cores, cold page cache: the apiserver alone can take tens of seconds


def toolchain() -> Toolchain:
    tc = Toolchain.default()
    missing = ""
    try:
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"):
            tc.binary(name)
    except MissingBinaryError as e:
        missing = str(e)
    if missing:
        # Never a skip: a stack test that silently does not run hides a broken stack.
        pytest.fail(f"{missing}\nRun `make binaries` first.", pytrace=False)
    return tc


@dataclass
class RunningStack:
    proc: subprocess.Popen[bytes]
    home: Path
    server: str
    stdout: Path
    stderr: Path
    kubectl: Path
    children: list[psutil.Process]

    def kubectl_run(self, *args: str, kubeconfig: Path | None = None, check: bool = True) -> str:
        res = subprocess.run(
            [str(self.kubectl), f"--kubeconfig={kubeconfig or self.home / 'kubeconfig'}", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and res.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({res.returncode}): {res.stderr}")
        return res.stdout if res.returncode == 0 else res.stderr

    def output(self) -> str:
        log = self.home / "logs" / "stack.log"
        return (
            f"--- stdout\n{self.stdout.read_text()}\n--- stderr (end)\n{self.stderr.read_text()[-6000:]}"
            f"\n--- stack.log (end)\n{log.read_text()[-4000:] if log.exists() else ''}"
        )


def stack_processes(home: Path) -> list[psutil.Process]:
    """Every process on the machine whose command line mentions this stack's home: the catch-all
    for orphans, whoever their parent is now."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmdline = " ".join(p.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if str(home) in cmdline and p.pid != os.getpid():
            found.append(p)
    return found


# Starts the launcher's argv with its environment, its console ending up in the two files (read
# for the ready line and for a failure's message).
Spawn = Callable[[list[str], dict[str, str], Path, Path], "subprocess.Popen[bytes]"]


def to_files(argv: list[str], env: dict[str, str], stdout: Path, stderr: Path) -> subprocess.Popen[bytes]:
    """The launcher's stdout and stderr straight into the files."""
    with stdout.open("wb") as out, stderr.open("wb") as err:
        return subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=out, stderr=err)


def launcher_argv(ports: Ports, *extra: str) -> list[str]:
    """`make up`'s command on test ports, etcd without fsync."""
    return [
        sys.executable, "-m", "localstack.main", "up",
        f"--apiserver-port={ports.apiserver}",
        f"--etcd-port={ports.etcd_client}",
        f"--etcd-peer-port={ports.etcd_peer}",
        f"--kcm-port={ports.kube_controller_manager}",
        f"--scheduler-port={ports.kube_scheduler}",
        "--etcd-unsafe-no-fsync",
        *extra,
    ]  # fmt: skip


def launch(home: Path, base: Path, *extra: str, spawn: Spawn = to_files) -> RunningStack:
    """Starts the launcher as `make up` would (plus test ports and no fsync) and waits for ready."""
    tc = toolchain()
    ports = free_stack_ports()
    stdout, stderr = base / "stdout.txt", base / "stderr.txt"
    proc = spawn(launcher_argv(ports, *extra), {**os.environ, "KUBELOOP_HOME": str(home)}, stdout, stderr)
    running = RunningStack(
        proc, home, f"https://127.0.0.1:{ports.apiserver}", stdout, stderr, tc.binary("kubectl"), []
    )
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the launcher exited with {proc.returncode} before ready\n{running.output()}")
            return READY_LINE in stdout.read_text()

        eventually("the stack's ready line", ready, START_TIMEOUT, 0.2, context=running.output)
        running.children = psutil.Process(proc.pid).children(recursive=True)
    except BaseException:
        cleanup(running)
        raise
    return running


def cleanup(running: RunningStack) -> None:
    if running.proc.poll() is None:
        running.proc.send_signal(signal.SIGTERM)
        try:
            running.proc.wait(60)
        except subprocess.TimeoutExpired:
            running.proc.kill()
    for p in stack_processes(running.home):
        p.kill()


@contextlib.contextmanager
def short_home() -> Iterator[Path]:
    """A stack home close to / : the node plugins' sockets live below it, and unix socket paths
    allow 107 bytes (pytest's own temporary directories can be too deep)."""
    home = Path(tempfile.mkdtemp(prefix="kls-", dir="/tmp"))
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)
