"""pv-controller with the real kube-scheduler (WaitForFirstConsumer), and as a separate process
under its own RBAC identity that is killed (SIGKILL) mid-way through binding and restarted."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from controller_runtime import storage
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.resources import (
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    Obj,
    Resource,
)
from controller_runtime.toolchain import REPO_ROOT
from localstack.certs import service_account_identity
from localstack.controlplane import ControlPlane
from localstack.proc import free_ports
from services.pv_controller import names
from tests.support.waits import eventually_async, no_problems

from .pods import create_pod, force_delete_pods
from .pv_controller_harness import PV, PVC, SC, Case, Harness, WantEvent, WantPVC, harness

pytestmark = pytest.mark.integration


HOSTNAME = "kubernetes.io/hostname"
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount", True)


async def create_ready_node(api: ApiClient, name: str) -> Obj:
    """A Node the scheduler can place pods on. No kubelet runs: nothing ever starts the pod."""
    node = await api.create(
        NODES,
        {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}}},
    )
    resources = {"cpu": "4", "memory": "8Gi", "pods": "110"}
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test node"}
    for _ in range(20):  # kcm's node controllers touch a new Node too: retry on conflict
        node["status"] = {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [ready],
        }
        try:
            return await api.update_status(NODES, node)
        except ApiError as exc:
            if not exc.conflict:
                raise
            node = await api.get(NODES, name)
    raise AssertionError(f"could not set the status of node {name}")


async def test_scheduler_prebinds_a_static_volume_and_the_pod_is_scheduled(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with harness(control_plane, api, namespace) as h:
        node = h.pv_name("node")
        await create_ready_node(api, node)
        try:
            await h.create_class(SC("local", storage.NO_PROVISIONER, wait_for_consumer=True))
            await h.create_pvc(PVC("data", cls="local"))
            pv = await h.create_pv(PV("local", "2Gi", cls="local"))
            pv["spec"]["nodeAffinity"] = {
                "required": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                }
            }
            await api.update(PERSISTENT_VOLUMES, pv)
            await h.start(resync=2)
            waiting = Case(
                "wffc",
                want_pvcs=(WantPVC("data", "Pending"),),
                want_events=(
                    WantEvent("data", names.WAIT_FOR_FIRST_CONSUMER, names.MSG_WAIT_FIRST_CONSUMER),
                ),
            )
            await h.converge(waiting)
            await create_pod(api, namespace, "app", "data")

            async def scheduled() -> list[str]:
                p = await api.get(PODS, "app", namespace)
                claim = await h.pvc("data")
                problems = []
                if p["spec"].get("nodeName") != node:
                    problems.append(f"pod on {p['spec'].get('nodeName')!r}")
                if claim["status"].get("phase") != "Bound" or claim["spec"].get("volumeName") != h.pv_name(
                    "local"
                ):
                    problems.append(f"claim {claim['status'].get('phase')} {claim['spec'].get('volumeName')}")
                return problems

            await eventually_async("scheduled", scheduled, 60, satisfied=no_problems)
            bound = await h.pv("local")
            assert bound is not None and bound["status"]["phase"] == "Bound"
            assert bound["spec"]["claimRef"]["uid"] == h.uids["data"]
        finally:
            await force_delete_pods(api, namespace)
            with contextlib.suppress(ApiError):
                await api.delete(NODES, node)


async def test_finished_pods_do_not_wait_for_scheduling(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """A WaitForFirstConsumer claim used only by a finished, never scheduled pod waits for its first
    consumer; one used by a live unscheduled pod names it (kcm's findNonScheduledPodsByPVC)."""
    async with harness(control_plane, api, namespace) as h:
        await h.create_class(SC("late", wait_for_consumer=True))
        await h.create_pvc(PVC("finished", cls="late"))
        await h.create_pvc(PVC("live", cls="late"))
        # A scheduler nobody runs: the real one would try to place the pods and select a node, and
        # with no scheduler and no kubelet nothing else writes the pod's status.
        done = await create_pod(api, namespace, "done", "finished", scheduler="nobody")
        done["status"] = {**done.get("status", {}), "phase": "Failed"}
        await api.update_status(PODS, done)
        await create_pod(api, namespace, "waiting", "live", scheduler="nobody")
        try:
            await h.start(resync=1)
            case = Case(
                "finished-pods",
                want_pvcs=(WantPVC("finished", "Pending"), WantPVC("live", "Pending")),
                want_events=(
                    WantEvent("finished", names.WAIT_FOR_FIRST_CONSUMER, names.MSG_WAIT_FIRST_CONSUMER),
                    WantEvent(
                        "live", names.WAIT_FOR_POD_SCHEDULED, names.msg_wait_pods_scheduled(["waiting"])
                    ),
                ),
            )
            await h.converge(case)
            reasons = {reason for obj, reason, _ in await h.events() if obj == "finished"}
            assert reasons == {names.WAIT_FOR_FIRST_CONSUMER}
        finally:
            await force_delete_pods(api, namespace)


async def test_scheduler_selects_a_node_and_the_claim_goes_to_the_provisioner(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with harness(control_plane, api, namespace) as h:
        node = h.pv_name("node")
        await create_ready_node(api, node)
        try:
            await h.create_class(SC("dynamic", wait_for_consumer=True))
            await h.create_pvc(PVC("data", cls="dynamic"))
            await h.start(resync=2)
            await create_pod(api, namespace, "app", "data")
            case = Case(
                "selected-node",
                want_pvcs=(
                    WantPVC(
                        "data",
                        "Pending",
                        annotations={
                            storage.ANN_SELECTED_NODE: node,
                            storage.ANN_STORAGE_PROVISIONER: "example.com/external",
                            storage.ANN_BETA_STORAGE_PROVISIONER: "example.com/external",
                        },
                    ),
                ),
                want_events=(WantEvent("data", names.EXTERNAL_PROVISIONING, "example.com/external"),),
            )
            await h.converge(case, timeout=60)
        finally:
            await force_delete_pods(api, namespace)
            with contextlib.suppress(ApiError):
                await api.delete(NODES, node)


# -- restart ---------------------------------------------------------------------------------------------

CLAIMS = 200


async def apply_rbac(cp: ControlPlane) -> None:
    kubectl = str(cp.toolchain.binary("kubectl"))
    proc = await asyncio.create_subprocess_exec(
        kubectl,
        f"--kubeconfig={cp.admin_kubeconfig}",
        "apply",
        "-f",
        str(REPO_ROOT / "deploy/rbac/pv-controller.yaml"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()


async def start_process(kubeconfig: Path, port: int, qps: int, log: Path) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.pv_controller.main",
        f"--kubeconfig={kubeconfig}",
        f"--kube-api-qps={qps}",
        f"--kube-api-burst={qps}",
        "--resync-period=2s",
        "--worker-threads=4",
        f"--http-endpoint=127.0.0.1:{port}",
        "--leader-election",
        "--leader-election-lease-duration=2s",
        "--leader-election-renew-deadline=1s",
        "--leader-election-retry-period=0.5s",
        cwd=REPO_ROOT,
        stdout=log.open("ab"),
        stderr=asyncio.subprocess.STDOUT,
    )


async def phases(api: ApiClient, h: Harness) -> tuple[list[Obj], list[Obj]]:
    claims = (await api.list_page(PERSISTENT_VOLUME_CLAIMS, h.ns))["items"]
    pvs = [
        p
        for p in (await api.list_page(PERSISTENT_VOLUMES))["items"]
        if p["metadata"]["name"].startswith(h.prefix)
    ]
    return claims, pvs


async def test_sigkill_mid_binding_then_restart_converges(
    control_plane: ControlPlane, api: ApiClient, namespace: str, tmp_path: Path
) -> None:
    await apply_rbac(control_plane)
    kubeconfig = control_plane.kubeconfig_for(service_account_identity("kubeloop-pv-controller"))
    log = tmp_path / "pv-controller.log"
    async with harness(control_plane, api, namespace) as h:
        await asyncio.gather(*(h.create_pv(PV(f"pv{i:03d}")) for i in range(CLAIMS)))
        await asyncio.gather(*(h.create_pvc(PVC(f"c{i:03d}")) for i in range(CLAIMS)))
        (port,) = free_ports(1)
        # Throttled so that the kill lands in the middle of the work.
        proc = await start_process(kubeconfig, port, 40, log)
        try:

            async def some_bound() -> list[str]:
                claims, _ = await phases(api, h)
                n = sum(1 for c in claims if c["status"].get("phase") == "Bound")
                return [] if n >= 20 else [f"{n} bound"]

            await eventually_async(
                "some bound", some_bound, 60, satisfied=no_problems, context=lambda: log.read_text()[-3000:]
            )
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/healthz") as r:
                assert r.status == 200
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        claims, _ = await phases(api, h)
        assert sum(1 for c in claims if c["status"].get("phase") == "Bound") < CLAIMS, "killed too late"

        proc = await start_process(kubeconfig, port, 400, log)
        try:

            async def all_bound() -> list[str]:
                claims, _ = await phases(api, h)
                n = sum(1 for c in claims if c["status"].get("phase") == "Bound")
                return [] if n == CLAIMS else [f"{n} bound"]

            await eventually_async(
                "all bound", all_bound, 90, satisfied=no_problems, context=lambda: log.read_text()[-3000:]
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 15) == 0

        claims, pvs = await phases(api, h)
        by_uid = {c["metadata"]["uid"]: c for c in claims}
        volume_names = [c["spec"]["volumeName"] for c in claims]
        assert len(set(volume_names)) == CLAIMS, "no volume bound to two claims"
        for pv in pvs:
            claim = by_uid[pv["spec"]["claimRef"]["uid"]]
            assert claim["spec"]["volumeName"] == pv["metadata"]["name"]
            assert pv["status"]["phase"] == "Bound"
            assert claim["metadata"]["annotations"][storage.ANN_BIND_COMPLETED] == "yes"
