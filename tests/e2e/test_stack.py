"""End-to-end: `python -m localstack.main up` as a real process, checked with the real kubectl,
then stopped with SIGTERM, leaving no process behind. Plus the component registry's mechanics
(identity, RBAC manifests, per-node instances, health, loud death) against a real apiserver."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from controller_runtime.certs import Identity
from controller_runtime.toolchain import REPO_ROOT, Toolchain
from localstack.certs import PKI, service_account_identity
from localstack.components import (
    REGISTRY,
    Component,
    ComponentContext,
    Components,
    instances,
    node_names,
)
from localstack.controlplane import ControlPlane, StackLockedError
from localstack.proc import ManagedProcess, free_ports, port_is_free
from localstack.testing import free_stack_ports, start_test_control_plane
from tests.support.waits import eventually, eventually_async

from .stacks import (
    PROMETHEUS_TEST_PORT,
    RunningStack,
    cleanup,
    launch,
    short_home,
    stack_processes,
    toolchain,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    base = tmp_path_factory.mktemp("stack")
    with short_home() as home:
        # With Prometheus (`make up PROMETHEUS=1`), on a free port.
        running = launch(home, base, "--prometheus", f"--prometheus-port={PROMETHEUS_TEST_PORT}")
        try:
            yield running
        finally:
            # Normally test_sigterm_stops_everything has stopped it; this only cleans up after a failure.
            cleanup(running)


def test_ready_and_reports_each_component(stack: RunningStack) -> None:
    out = stack.stdout.read_text()
    control_plane = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"]
    for name in control_plane + [i.name for i in instances(REGISTRY, node_names(1))] + ["prometheus"]:
        assert f"ok  {name}" in out, out
    assert f"export KUBECONFIG={stack.home / 'kubeconfig'}" in out
    names = {p.name() for p in stack.children}
    assert names >= set(control_plane), names
    assert (stack.home / "kubeconfig").stat().st_mode & 0o777 == 0o600
    # The console has the status lines only; the launcher's structured lines are in its log file.
    assert "ts=" not in stack.stderr.read_text() and "ts=" not in out
    assert "msg=healthy component=pv-controller" in (stack.home / "logs" / "stack.log").read_text()


def test_prometheus_scrapes_every_component_and_loads_the_alerting_rules(stack: RunningStack) -> None:
    api = f"http://127.0.0.1:{PROMETHEUS_TEST_PORT}/api/v1"

    def targets() -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{api}/targets", timeout=10) as r:
            active: list[dict[str, Any]] = json.load(r)["data"]["activeTargets"]
        return active

    active = eventually(
        "every target up",
        targets,
        60,
        2,
        satisfied=lambda active: active and all(t["health"] == "up" for t in active),
    )
    scraped = {t["labels"]["component"] for t in active}
    assert scraped == {i.name for i in instances(REGISTRY, node_names(2)) if i.http_port is not None}
    with urllib.request.urlopen(f"{api}/rules", timeout=10) as r:
        groups = {g["name"] for g in json.load(r)["data"]["groups"]}
    assert groups == {
        "kubeloop-volumes",
        "kubeloop-claims",
        "kubeloop-operations",
        "kubeloop-pools",
        "kubeloop-control-plane",
    }
    query = urllib.parse.quote("up == 1")
    with urllib.request.urlopen(f"{api}/query?query={query}", timeout=10) as r:
        assert len(json.load(r)["data"]["result"]) == len(scraped)
    # The stack's shared pool is exported once, by the controller-mode driver (csi_driver.pool_metrics).
    query = urllib.parse.quote("kubeloop_pool_filesystem_size_bytes")
    with urllib.request.urlopen(f"{api}/query?query={query}", timeout=10) as r:
        exporters = [s["metric"]["component"] for s in json.load(r)["data"]["result"]]
    assert exporters == ["csi-driver-controller"]
    # The Grafana dashboard's queries are ones this Prometheus evaluates (a typo is a 400).
    dashboard = json.loads((REPO_ROOT / "deploy" / "grafana" / "kubeloop-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            with urllib.request.urlopen(
                f"{api}/query?query={urllib.parse.quote(target['expr'])}", timeout=10
            ) as r:
                assert json.load(r)["status"] == "success", (panel["title"], target["expr"])


def test_readyz_and_pinned_version(stack: RunningStack) -> None:
    assert stack.kubectl_run("get", "--raw", "/readyz").strip() == "ok"
    version = json.loads(stack.kubectl_run("get", "--raw", "/version"))
    assert version["gitVersion"] == Toolchain.default().kubernetes_version == "v1.36.3"


def test_rbac_is_enforced(stack: RunningStack, tmp_path: Path) -> None:
    # An authenticated identity with no bindings at all: RBAC (not AlwaysAllow) must refuse it.
    nobody = PKI(stack.home / "pki").write_kubeconfig(
        Identity("kubeloop-e2e-nobody"), stack.server, tmp_path / "nobody.kubeconfig"
    )
    err = stack.kubectl_run("get", "persistentvolumes", kubeconfig=nobody, check=False)
    assert "forbidden" in err.lower(), err
    assert 'User "kubeloop-e2e-nobody" cannot list resource "persistentvolumes"' in err, err
    # ...while the admin can.
    stack.kubectl_run("get", "persistentvolumes")


def test_kcm_runs_namespace_and_serviceaccount_controllers(stack: RunningStack) -> None:
    ns = f"e2e-stack-{uuid.uuid4().hex[:8]}"
    stack.kubectl_run("create", "namespace", ns)
    # Content in the namespace makes the namespace controller do real work before it can finish.
    stack.kubectl_run("-n", ns, "create", "configmap", "payload", "--from-literal=k=v")
    eventually(
        "kcm's serviceaccount controller to create 'default'",
        lambda: "default" in stack.kubectl_run("-n", ns, "get", "serviceaccounts", "-o", "name"),
        60,
        0.2,
    )
    stack.kubectl_run("delete", "namespace", ns, "--wait=false")
    eventually(
        f"namespace {ns} deleted (kcm working)",
        lambda: stack.kubectl_run("get", "namespace", ns, "-o", "name", check=False),
        90,
        0.3,
        satisfied=lambda res: "NotFound" in res,
    )


def _status(stack: RunningStack) -> dict[str, dict[str, object]]:
    data: dict[str, dict[str, dict[str, object]]] = json.loads((stack.home / "status.json").read_text())
    return data["components"]


@dataclass(frozen=True)
class Says:
    """`satisfied` for a console: its text has the line."""

    line: str

    def __call__(self, text: str) -> bool:
        return self.line in text


def test_killed_component_is_restarted_and_claims_still_bind(stack: RunningStack, tmp_path: Path) -> None:
    """kill -9 of the two processes a claim's binding needs: the launcher restarts each (printed,
    counted in status.json) and a claim created afterwards is provisioned and bound."""
    before = _status(stack)
    victims = ("external-provisioner", "pv-controller")
    for name in victims:
        assert before[name]["running"] and before[name]["restarts"] == 0, before[name]
        os.kill(int(str(before[name]["pid"])), signal.SIGKILL)
    for name in victims:
        line = f"restarted {name} (exit code -9), attempt 1, next backoff 2s"
        eventually(
            f"{name} restarted", stack.stdout.read_text, 60, 0.2, satisfied=Says(line), context=stack.output
        )
        now = _status(stack)[name]
        assert now["restarts"] == 1 and now["last_exit_code"] == -9, now
        assert now["pid"] != before[name]["pid"] and psutil.pid_exists(int(str(now["pid"])))
    ns = f"e2e-restart-{uuid.uuid4().hex[:8]}"
    stack.kubectl_run("create", "namespace", ns)
    claim = tmp_path / "claim.json"
    claim.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "after-restart", "namespace": ns},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "16Mi"}}},
            }
        )
    )
    stack.kubectl_run("create", "-f", str(claim))
    eventually(
        "the claim bound after the restarts",
        lambda: stack.kubectl_run("-n", ns, "get", "pvc", "after-restart", "-o", "jsonpath={.status.phase}"),
        90,
        0.3,
        satisfied=lambda phase: phase == "Bound",
        context=stack.output,
    )
    stack.kubectl_run("delete", "namespace", ns, "--wait=false")


def test_sigterm_stops_everything(stack: RunningStack) -> None:
    assert stack.children, "no child processes were recorded"
    restarts = stack.stdout.read_text().count("restarted ")
    stack.proc.send_signal(signal.SIGTERM)
    code = stack.proc.wait(90)
    assert code == 0, stack.output()
    assert stack.stdout.read_text().count("restarted ") == restarts, "nothing is restarted on the way down"
    _gone, alive = psutil.wait_procs(stack.children, timeout=5)
    assert not alive, f"orphaned: {[(p.pid, p.name()) for p in alive]}"
    assert stack_processes(stack.home) == []
    assert "kubeloop: stopped" in stack.stdout.read_text()


def test_killed_launcher_leaves_no_orphans_and_restart_reuses_state(tmp_path: Path) -> None:
    """SIGKILL gives the launcher no chance to clean up: the children's parent-death signal must.
    A new launcher on the same home then reuses the certificates and etcd's data."""
    with short_home() as home:
        _kill_and_restart(home, tmp_path)


def _kill_and_restart(home: Path, tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    first = launch(home, tmp_path / "1")
    try:
        first.kubectl_run("create", "namespace", "survives-restart")
        pki = {p: p.read_bytes() for p in (home / "pki").rglob("*") if p.is_file()}
        first.proc.kill()
        first.proc.wait(10)
        _gone, alive = psutil.wait_procs(first.children, timeout=10)
        assert not alive, f"orphaned after SIGKILL: {[(p.pid, p.name()) for p in alive]}"
    finally:
        cleanup(first)
    (tmp_path / "2").mkdir()
    second = launch(home, tmp_path / "2")
    try:
        assert {p: p.read_bytes() for p in (home / "pki").rglob("*") if p.is_file()} == pki
        assert "namespace/survives-restart" in second.kubectl_run("get", "namespace", "-o", "name")
        assert (home / "logs" / "kube-apiserver.previous.log").exists()
    finally:
        cleanup(second)
    assert second.proc.returncode == 0


def test_refuses_a_home_too_deep_for_unix_sockets(tmp_path: Path) -> None:
    toolchain()
    home = tmp_path / ("d" * 60) / "home"
    res = subprocess.run(
        [sys.executable, "-m", "localstack.main", "up"],
        cwd=REPO_ROOT, env={**os.environ, "KUBELOOP_HOME": str(home)}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert res.returncode == 2
    assert "too deep" in res.stderr and "107" in res.stderr, res.stderr
    assert not (home / "etcd").exists()


def test_refuses_taken_port() -> None:
    toolchain()
    with short_home() as home:
        _refuses_taken_port(home)


def _refuses_taken_port(home: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-m", "localstack.main", "up", f"--apiserver-port={taken}"],
            cwd=REPO_ROOT,
            env={**os.environ, "KUBELOOP_HOME": str(home)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert res.returncode == 2
    assert f"port {taken}" in res.stderr and "kube-apiserver" in res.stderr, res.stderr
    assert not (home / "etcd").exists(), "nothing may start when a port is taken"


async def _kubectl(kubectl: Path, kubeconfig: Path, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        str(kubectl), f"--kubeconfig={kubeconfig}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode(), err.decode()


def _two_consecutive_free_ports() -> int:
    for _ in range(50):
        (port,) = free_ports(1)
        if port < 65535 and port_is_free(port + 1):
            return port
    raise AssertionError("no two consecutive free ports")


async def test_component_registry_mechanics(tmp_path: Path) -> None:
    """A trivial per-node entry (python's http.server, not a fake kubeloop component) exercises
    what a real registry entry gets: its own identity and kubeconfig, its RBAC manifest applied,
    one instance per node on its own port, health waiting, a loud report when it dies, clean stop."""
    tc = toolchain()
    cp = await start_test_control_plane(tmp_path / "home")
    try:
        base_port = _two_consecutive_free_ports()
        manifest = tmp_path / "rbac.yaml"
        manifest.write_text(
            """
apiVersion: v1
kind: ServiceAccount
metadata: {name: kubeloop-e2e-probe, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: kubeloop-e2e-probe}
rules: [{apiGroups: [""], resources: [persistentvolumes], verbs: [list]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: kubeloop-e2e-probe}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: kubeloop-e2e-probe}
subjects: [{kind: ServiceAccount, name: kubeloop-e2e-probe, namespace: kube-system}]
"""
        )
        seen: list[ComponentContext] = []

        def argv(ctx: ComponentContext) -> list[str]:
            seen.append(ctx)
            port = ctx.http_endpoint.rpartition(":")[2]
            return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", port,
                    "--directory", str(ctx.state_dir)]  # fmt: skip

        probe = Component(
            name="probe",
            argv=argv,
            identity=service_account_identity("kubeloop-e2e-probe"),
            http_port=base_port,
            health_path="/",
            per_node=True,
            manifests=(str(manifest),),
        )
        deaths: list[tuple[str, int]] = []

        def died(proc: ManagedProcess, code: int) -> None:
            deaths.append((proc.name, code))

        # One stack per home: a second control plane on it must refuse, not corrupt etcd's data.
        with pytest.raises(StackLockedError, match="another kubeloop stack"):
            await ControlPlane(cp.home, free_stack_ports(), with_kcm=False, with_scheduler=False).start()
        # restart_apiserver keeps the data (etcd is untouched) and returns once ready again.
        assert await cp.restart_apiserver() > 0
        comps = Components(cp, [probe], ["node-1", "node-2"], on_unexpected_exit=died)
        await comps.start()
        try:
            assert sorted(comps.processes) == ["probe-node-1", "probe-node-2"]
            assert sorted(c.node or "" for c in seen) == ["node-1", "node-2"]
            assert sorted(c.http_endpoint for c in seen) == [
                f"127.0.0.1:{base_port}",
                f"127.0.0.1:{base_port + 1}",
            ]
            kubeconfig = seen[0].kubeconfig
            assert kubeconfig is not None and kubeconfig != cp.admin_kubeconfig
            kubectl = tc.binary("kubectl")
            code, out, err = await _kubectl(kubectl, kubeconfig, "auth", "whoami", "-o", "json")
            assert code == 0, err
            user = json.loads(out)["status"]["userInfo"]
            assert user["username"] == "system:serviceaccount:kube-system:kubeloop-e2e-probe"
            # The manifest granted exactly `list persistentvolumes`, and nothing else.
            code, _, err = await _kubectl(kubectl, kubeconfig, "get", "pv")
            assert code == 0, err
            code, _, err = await _kubectl(kubectl, kubeconfig, "get", "pvc", "-A")
            assert code != 0 and "forbidden" in err.lower(), err

            victim = comps.processes["probe-node-2"]
            assert victim.pid is not None
            os.kill(victim.pid, signal.SIGKILL)

            async def reported() -> bool:
                return bool(deaths)

            await eventually_async("the death of a component reported", reported, 10, 0.05)
            assert deaths == [("probe-node-2", -signal.SIGKILL)]
        finally:
            pids = [p.pid for p in comps.processes.values() if p.pid is not None]
            await comps.stop()
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids)
    finally:
        await cp.stop()
    assert stack_processes(tmp_path / "home") == []
