"""The docker-compose stack, built and started once for tests/compose (and torn down right after them,
before the rest of the suite runs).

The fixture sets up docker with tools/docker-env.sh (starting a local-only dockerd when none
answers, and stopping it at the end), builds every image with tools/build-images.sh, runs
`docker-compose up -d` under its own project name and waits for every service to be healthy. At the
end `docker-compose down -v` must leave no container, volume, loop device or mount behind. When
docker cannot be set up the tests fail, never skip (CI runs them from `make test`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from controller_runtime.toolchain import REPO_ROOT, Toolchain
from tests.support.waits import WaitFailed, eventually

PROJECT = "kubeloop-compose-test"
COMPOSE_HOME = REPO_ROOT / ".kubeloop" / "compose"
ONE_SHOT = {"init", "setup"}


def run(
    args: list[str],
    timeout: float = 120,
    check: bool = True,
    input: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=REPO_ROOT,
        input=input,
        env=env,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


@dataclass
class Stack:
    kubectl_path: str
    kubeconfig: Path
    figures: dict[str, float] = field(default_factory=dict)
    loops_before: set[str] = field(default_factory=set)

    def pool_loop_devices(self) -> list[str]:
        """Loop devices of the compose pool attached now (and not before the stack started)."""
        return _leftovers(self.loops_before)[1]

    def leftovers(self) -> tuple[list[str], list[str]]:
        """The stack's mounts (in the daemon's mount namespace and here) and its pool's loop devices."""
        return _leftovers(self.loops_before)

    def compose(
        self, *args: str, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return run(["docker-compose", "-p", PROJECT, *args], timeout=timeout, check=check)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        return run(
            [self.kubectl_path, f"--kubeconfig={self.kubeconfig}", *args], check=check, input=input
        ).stdout

    def exec(self, service: str, script: str, check: bool = True) -> str:
        return self.compose("exec", "-T", service, "sh", "-c", script, timeout=60, check=check).stdout

    def restarts(self, service: str) -> int:
        """How often the service's container was restarted by its restart policy."""
        container = self.compose("ps", "-q", service).stdout.split()[0]
        return int(run(["docker", "inspect", "--format", "{{.RestartCount}}", container]).stdout.strip())

    def mounted(self, service: str, path: str) -> bool:
        """Whether `path` is a loop device's mount in the service's container."""
        out = self.compose("exec", "-T", service, "findmnt", "-rn", "-o", "SOURCE", path, check=False)
        return out.returncode == 0 and out.stdout.startswith("/dev/loop")

    def kill_main_process(self, service: str) -> None:
        """SIGKILL to the service's process from the host: the child of the container's init."""
        container = self.compose("ps", "-q", service).stdout.split()[0]
        init_pid = run(["docker", "inspect", "--format", "{{.State.Pid}}", container]).stdout.strip()
        children = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
        assert children, f"{service}: its init has no child"
        for pid in children:
            os.kill(int(pid), 9)

    def services(self) -> list[str]:
        return [s for s in self.compose("config", "--services").stdout.split() if s not in ONE_SHOT]

    def health(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for service in self.services():
            ids = self.compose("ps", "-q", service).stdout.split()
            if not ids:
                out[service] = "missing"
                continue
            state = json.loads(run(["docker", "inspect", "--format", "{{json .State}}", ids[0]]).stdout)
            out[service] = (state.get("Health") or {}).get("Status", state.get("Status", "?"))
        return out

    def wait_healthy(self, timeout: float = 180) -> float:
        start = time.monotonic()
        eventually(
            "every service healthy",
            self.health,
            timeout,
            1,
            # "running": a service without a healthcheck (upstream's binaries in scratch images).
            satisfied=lambda health: all(h in ("healthy", "running") for h in health.values()),
            context=lambda: self.compose("logs", "--tail=30", check=False).stdout[-6000:],
        )
        return time.monotonic() - start


def _loop_devices() -> set[str]:
    out = run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"], check=False).stdout
    return {line.strip() for line in out.splitlines() if line.strip()}


def _leftovers(loops_before: set[str]) -> tuple[list[str], list[str]]:
    """Mounts of the stack, seen from the daemon's mount namespace (tools/docker-env.sh nsenter) and
    from here, and loop devices of the compose pool attached since the stack started."""
    mounts: set[str] = set()
    for prefix in (["bash", "tools/docker-env.sh", "nsenter"], []):
        out = run([*prefix, "findmnt", "-rn", "-o", "TARGET"], check=False).stdout
        mounts |= {m for m in out.splitlines() if ".kubeloop/compose" in m or "/var/lib/kubeloop" in m}
    # Only the compose pool's: other stacks on this machine (tests/e2e) attach their own meanwhile.
    # A backing file deleted with its volume shows as /volumes/<id>.img (deleted).
    loops = [
        line
        for line in sorted(_loop_devices() - loops_before)
        if " /var/lib/kubeloop/pool/" in line or " /volumes/vol-" in line
    ]
    return sorted(mounts), loops


@pytest.fixture(scope="package")
def stack() -> Iterator[Stack]:
    if os.geteuid() != 0:
        pytest.fail("tests/compose need root (dockerd, loop devices)")
    started = run(["bash", "tools/docker-env.sh", "start"], timeout=180, check=False)
    if started.returncode != 0:
        pytest.fail(f"could not set up docker (tools/docker-env.sh start):\n{started.stderr}")
    we_started = started.stdout.strip() == "started"
    loops_before = _loop_devices()
    figures: dict[str, float] = {}
    try:
        t = time.monotonic()
        env = {**os.environ, "PYTHON": sys.executable}
        build = run(["bash", "tools/build-images.sh"], timeout=900, check=False, env=env)
        if build.returncode != 0:
            pytest.fail(f"tools/build-images.sh failed:\n{build.stderr[-4000:]}")
        figures["build_images_s"] = time.monotonic() - t
        kubectl = str(Toolchain.default().binary("kubectl"))
        s = Stack(kubectl, COMPOSE_HOME / "kubeconfig", figures, loops_before)
        s.compose("down", "-v", "--remove-orphans", check=False)
        t = time.monotonic()
        up = s.compose("up", "-d", timeout=600, check=False)
        if up.returncode != 0:
            logs = s.compose("logs", "--tail=40", check=False).stdout[-8000:]
            pytest.fail(f"docker-compose up -d failed:\n{up.stderr[-3000:]}\n{logs}")
        s.wait_healthy()
        figures["up_to_healthy_s"] = time.monotonic() - t
        yield s
    finally:
        if os.environ.get("KUBELOOP_COMPOSE_KEEP") == "1":
            # Debugging: leave the stack (and the daemon) running; `docker-compose -p PROJECT down -v`.
            print(f"\nKUBELOOP_COMPOSE_KEEP=1: the stack {PROJECT} keeps running")
            problems = []
        else:
            problems = _tear_down(loops_before)
            shutil.rmtree(COMPOSE_HOME / "nodes", ignore_errors=True)
            if we_started:
                run(["bash", "tools/docker-env.sh", "stop"], timeout=120, check=False)
        print(f"\ncompose figures: {json.dumps({k: round(v, 1) for k, v in figures.items()})}")
        if problems:
            pytest.fail("\n".join(problems))


def _tear_down(loops_before: set[str]) -> list[str]:
    """Deletes what the tests left in the cluster (a failed test may leave a pod), then `docker-compose
    down -v`, which must leave nothing; whatever it leaves is reported and then removed by force, so
    the machine is clean either way."""
    kubectl = str(Toolchain.default().binary("kubectl"))
    kc = f"--kubeconfig={COMPOSE_HOME / 'kubeconfig'}"
    if (COMPOSE_HOME / "kubeconfig").exists():
        for kind in ("pods", "pvc"):
            run(
                [kubectl, kc, "delete", kind, "--all", "--all-namespaces", "--timeout=90s"],
                timeout=120,
                check=False,
            )

        def no_pv() -> bool:
            pvs = run([kubectl, kc, "get", "pv", "-o", "name"], check=False)
            return pvs.returncode != 0 or not pvs.stdout.strip()

        with contextlib.suppress(WaitFailed):  # what is left is reported below
            eventually("every PV gone", no_pv, 60, 1)
    problems = []
    down = run(["docker-compose", "-p", PROJECT, "down", "-v", "--remove-orphans"], timeout=300, check=False)
    if down.returncode != 0:
        problems.append(f"docker-compose down -v failed: {down.stderr[-2000:]}")
    label = f"label=com.docker.compose.project={PROJECT}"
    left = run(["docker", "ps", "-aq", "--filter", label], check=False).stdout.split()
    vols = run(["docker", "volume", "ls", "-q", "--filter", label], check=False).stdout.split()
    if left or vols:
        problems.append(f"left behind: containers {left} volumes {vols}")
    mounts, loops = _leftovers(loops_before)
    if mounts or loops:
        problems.append(f"left behind: mounts {mounts} loop devices {loops}")
    for m in sorted(mounts, reverse=True):
        run(["bash", "tools/docker-env.sh", "nsenter", "umount", "-l", m], check=False)
        run(["umount", "-l", m], check=False)
    for loop in loops:
        run(["losetup", "--detach", loop.split()[0]], check=False)
    return problems
