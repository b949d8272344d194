"""The node finalizer against the real apiserver, with kcm's protection controllers running (they
remove pvc- and pv-protection, which the admission plugins add): a Node gets the finalizer; a
deleted Node's node-local volumes are cleaned up (claims deleted, Delete-policy PVs deleted and the
external-provisioner's finalizer removed, Retain PVs kept) with events, shared-pool volumes and
another node's are not, and the Node goes; a finalizer stopped at any step (as by kill -9) and
started again converges. The PVs and their phases are written by the test, as the pv-controller
and the provisioner would (kcm's binder is off in the test control plane)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.controller import ControllerContext
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.metrics import REGISTRY
from controller_runtime.resources import (
    CSI_DRIVERS,
    EVENTS,
    LEASES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    Obj,
    Resource,
)
from controller_runtime.toolchain import REPO_ROOT
from localstack.controlplane import ControlPlane
from node_finalizer import messages
from node_finalizer.controller import NodeFinalizer, Options
from node_finalizer.decide import DRIVER_NAME, FINALIZER, PROVISIONER_FINALIZER, TOPOLOGY_KEY
from tests.support.namespaces import default_service_account
from tests.support.waits import consistently_async, eventually_async
from tests.support.writes import until_written

pytestmark = pytest.mark.integration

PV_PROTECTION = "kubernetes.io/pv-protection"
# What waits on kcm's pvc- and pv-protection controllers (a claim or PV going once its finalizer is
# lifted). Their clients make 20 requests/s: in the full suite they can still be working through an
# earlier test's namespace of 200 claims and PVs, and a 30 s wait once ran out (CI-equivalent run).
KCM_TIMEOUT = 120.0


async def wait_gone(c: Cluster, res: Resource, name: str, namespace: str | None, what: str) -> None:
    """Waits for an object that only kcm's protection controllers still hold; on a time-out, says
    what holds it (its finalizers, and the pods left in its namespace). kcm's protection
    controllers act on events: on a loaded machine (a CI run) an event they handled before their
    caches had the pod's deletion is not offered again until a resync, so the object is touched
    every 15 s, an update they act on as kcm's own resync would."""
    touched = 0

    async def gone() -> bool:
        nonlocal touched
        if await c.gone(res, name, namespace):
            return True
        touched += 1
        if touched % 150 == 0:  # wait_for polls every 0.1 s
            with contextlib.suppress(ApiError):
                patch = {"metadata": {"annotations": {"kubeloop.dev/test-nudge": str(touched)}}}
                await c.api.patch(res, name, patch, namespace=namespace)
        return False

    try:
        await eventually_async(what, gone, KCM_TIMEOUT)
    except AssertionError:
        obj = await c.get(res, name, namespace) or {}
        pods = [p["metadata"]["name"] for p in (await c.api.list_page(PODS, c.ns))["items"]]
        held = obj.get("metadata", {}).get("finalizers")
        raise AssertionError(f"timed out waiting for {what}: finalizers {held}, pods {pods}") from None


def volumes_cleaned(action: str) -> float:
    return (
        REGISTRY.get_sample_value("kubeloop_node_finalizer_volumes_cleaned_total", {"action": action}) or 0.0
    )


class Cluster:
    """Nodes, claims and PVs of one test, and node finalizers to start and stop."""

    def __init__(self, api: ApiClient, cp: ControlPlane, namespace: str) -> None:
        self.api, self.cp, self.ns = api, cp, namespace
        self.suffix = uuid.uuid4().hex[:6]
        self.nodes: list[str] = []
        self.pvs: list[str] = []
        self.running: list[tuple[asyncio.Task[None], list[Callable[[], Awaitable[None]]]]] = []
        self.csidriver_before: Obj | None = None

    def name(self, short: str) -> str:
        return f"{short}-{self.suffix}"

    async def csidriver(self, attach_required: bool) -> None:
        """The driver's CSIDriver in the mode asked for (put back as it was afterwards)."""
        with contextlib.suppress(ApiError):
            self.csidriver_before = self.csidriver_before or await self.api.get(CSI_DRIVERS, DRIVER_NAME)
        with contextlib.suppress(ApiError):
            await self.api.delete(CSI_DRIVERS, DRIVER_NAME)
        spec = {
            "attachRequired": attach_required,
            "podInfoOnMount": False,
            "volumeLifecycleModes": ["Persistent"],
        }
        # The delete above may still be in flight.
        await until_written(
            "the test's CSIDriver",
            lambda: self.api.create(CSI_DRIVERS, {"metadata": {"name": DRIVER_NAME}, "spec": spec}),
            lambda err: err.already_exists,
        )

    async def start(self, cls: type[NodeFinalizer] = NodeFinalizer, **options: Any) -> NodeFinalizer:
        client = await ApiClient.from_kubeconfig(str(self.cp.admin_kubeconfig), qps=0, burst=1)
        recorder = EventRecorder(client, "kubeloop-node-finalizer")
        factory = SharedInformerFactory(client)
        finalizer = cls(ControllerContext(client, factory, recorder), Options(**options))
        task = asyncio.create_task(finalizer.run())
        self.running.append((task, [recorder.close, client.close, factory.stop]))
        await asyncio.wait_for(factory.wait_for_sync(), 30)
        return finalizer

    async def stop_all(self) -> None:
        """Cancels every finalizer started: to them, as abrupt as kill -9 (they keep no state
        outside the API, so what a restart sees is what the API holds)."""
        for task, closers in self.running:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            for close in closers:
                await close()
        self.running.clear()

    async def node(self, short: str) -> str:
        name = self.name(short)
        await self.api.create(NODES, {"metadata": {"name": name, "labels": {TOPOLOGY_KEY: name}}})
        self.nodes.append(name)
        return name

    async def has_finalizer(self, node: str) -> bool:
        return FINALIZER in ((await self.api.get(NODES, node))["metadata"].get("finalizers") or [])

    async def waiting_claim(self, short: str, node: str) -> None:
        """A WaitForFirstConsumer claim of the driver for which the scheduler chose `node`, not
        provisioned yet (as the pv-controller and kube-scheduler annotate it)."""
        annotations = {
            "volume.kubernetes.io/storage-provisioner": DRIVER_NAME,
            "volume.kubernetes.io/selected-node": node,
        }
        await self.api.create(
            PERSISTENT_VOLUME_CLAIMS,
            {
                "metadata": {"name": short, "annotations": annotations},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}},
                    "storageClassName": "kubeloop-wffc",
                },
            },
            self.ns,
        )

    async def selected_node(self, short: str) -> str | None:
        claim = await self.api.get(PERSISTENT_VOLUME_CLAIMS, short, self.ns)
        return (claim["metadata"].get("annotations") or {}).get("volume.kubernetes.io/selected-node")

    async def claim(self, short: str) -> Obj:
        return await self.api.create(
            PERSISTENT_VOLUME_CLAIMS,
            {
                "metadata": {"name": short},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}},
                    "storageClassName": "",
                    "volumeName": self.name(short),
                },
            },
            self.ns,
        )

    async def pv(
        self,
        short: str,
        nodes: list[str],
        *,
        claim: Obj | None = None,
        claim_uid: str | None = None,
        policy: str = "Delete",
        phase: str = "Bound",
    ) -> str:
        """A PV of the driver as the provisioner makes it (its finalizer, one affinity term per
        node), bound to `claim` (or with a claimRef to a claim that is gone), in `phase`."""
        name = self.name(short)
        terms = [
            {"matchExpressions": [{"key": TOPOLOGY_KEY, "operator": "In", "values": [n]}]} for n in nodes
        ]
        ref = {"namespace": self.ns, "name": short, "uid": claim["metadata"]["uid"] if claim else claim_uid}
        pv = await self.api.create(
            PERSISTENT_VOLUMES,
            {
                "metadata": {"name": name, "finalizers": [PROVISIONER_FINALIZER]},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": policy,
                    "storageClassName": "",
                    "claimRef": ref,
                    "csi": {"driver": DRIVER_NAME, "volumeHandle": f"pvc-{short}"},
                    "nodeAffinity": {"required": {"nodeSelectorTerms": terms}},
                },
            },
        )
        self.pvs.append(name)
        pv["status"] = {"phase": phase}
        await self.api.update_status(PERSISTENT_VOLUMES, pv)
        if claim is not None:
            claim["status"] = {
                "phase": "Bound",
                "accessModes": ["ReadWriteOnce"],
                "capacity": {"storage": "1Gi"},
            }
            await self.api.update_status(PERSISTENT_VOLUME_CLAIMS, claim)
        return name

    async def pod(self, short: str, node: str, claim: str) -> None:
        """A pod already bound to `node` (no kubelet runs it) using `claim`: pvc-protection holds
        the claim while it exists."""
        body = {
            "metadata": {"name": short},
            "spec": {
                "nodeName": node,
                # kcm's taint eviction must not delete it from the unreachable node first.
                "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "c", "image": "registry.invalid/none"}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}],
            },
        }
        await default_service_account(self.api, self.ns)
        await self.api.create(PODS, body, self.ns)

    async def delete_pod(self, name: str) -> None:
        """At once, as kcm's pod GC deletes a pod of a Node that is gone (no kubelet confirms)."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0}
        await self.api.request("DELETE", PODS.path(self.ns, name), body=body)

    async def get(self, res: Resource, name: str, namespace: str | None = None) -> Obj | None:
        try:
            return await self.api.get(res, name, namespace)
        except ApiError as e:
            if e.not_found:
                return None
            raise

    async def gone(self, res: Resource, name: str, namespace: str | None = None) -> bool:
        return await self.get(res, name, namespace) is None

    async def events(self, namespace: str, name: str) -> set[str]:
        items = (await self.api.list_page(EVENTS, namespace))["items"]
        return {e["reason"] for e in items if e["involvedObject"].get("name") == name}

    async def close(self) -> None:
        await self.stop_all()
        # The finalizer went on every Node of the shared control plane: take it off all of them,
        # or another test's Node deletion would wait for a finalizer that no longer runs.
        for node in (await self.api.list_page(NODES))["items"]:
            have = node["metadata"].get("finalizers") or []
            if FINALIZER in have:
                with contextlib.suppress(ApiError):
                    await self.api.patch(
                        NODES,
                        node["metadata"]["name"],
                        {"metadata": {"finalizers": [f for f in have if f != FINALIZER]}},
                    )
        for name in self.nodes:
            with contextlib.suppress(ApiError):
                await self.api.delete(NODES, name)
        for name in self.pvs:
            with contextlib.suppress(ApiError):
                await self.api.patch(PERSISTENT_VOLUMES, name, {"metadata": {"finalizers": None}})
                await self.api.delete(PERSISTENT_VOLUMES, name)
        with contextlib.suppress(ApiError):
            await self.api.delete(CSI_DRIVERS, DRIVER_NAME)
        if self.csidriver_before is not None:
            before = self.csidriver_before
            await eventually_async(
                "the test's CSIDriver gone", lambda: self.gone(CSI_DRIVERS, DRIVER_NAME), 10
            )
            await self.api.create(CSI_DRIVERS, {"metadata": {"name": DRIVER_NAME}, "spec": before["spec"]})


@pytest_asyncio.fixture(loop_scope="session")
async def cluster(control_plane: ControlPlane, api: ApiClient, namespace: str) -> AsyncIterator[Cluster]:
    c = Cluster(api, control_plane, namespace)
    try:
        yield c
    finally:
        await c.close()


async def test_a_deleted_nodes_volumes_are_cleaned_up_and_the_node_goes(cluster: Cluster) -> None:
    c, api, ns = cluster, cluster.api, cluster.ns
    await c.csidriver(attach_required=False)
    await c.start()
    node_a, node_b = await c.node("nf-a"), await c.node("nf-b")
    await eventually_async("the finalizer on node-a", lambda: c.has_finalizer(node_a), 20)
    await eventually_async("the finalizer on node-b", lambda: c.has_finalizer(node_b), 20)

    used = await c.claim("used")  # bound, a pod on node-a uses it
    pv_used = await c.pv("used", [node_a], claim=used)
    await c.pod("user", node_a, "used")
    pv_released = await c.pv("released", [node_a], claim_uid=str(uuid.uuid4()), phase="Released")
    kept = await c.claim("kept")
    pv_kept = await c.pv("kept", [node_a], claim=kept, policy="Retain")
    shared = await c.claim("shared")  # accessible from both nodes: the shared pool's
    pv_shared = await c.pv("shared", [node_a, node_b], claim=shared)
    other = await c.claim("other")  # node-b's, which is NotReady (no kubelet) but not deleted
    pv_other = await c.pv("other", [node_b], claim=other)
    await c.waiting_claim("waiting-a", node_a)  # the scheduler chose node-a, no volume made yet
    await c.waiting_claim("waiting-b", node_b)
    actions = ("claim-deleted", "volume-deleted", "volume-retained", "claim-rescheduled")
    before = {a: volumes_cleaned(a) for a in actions}

    async def used_pv_kept() -> bool:
        return (await api.get(PERSISTENT_VOLUMES, pv_used))["metadata"].get("deletionTimestamp") is None

    await consistently_async("a live node's volume left alone", used_pv_kept, 1)

    await api.delete(NODES, node_a)
    await eventually_async("node-a gone", lambda: c.gone(NODES, node_a), 30)

    # The claim in use is being deleted (pvc-protection waits for the pod, which kcm's pod GC
    # removes once the Node is gone), its PV deleted with only pv-protection left (kcm lifts it once
    # the binder marks the PV Released).
    claim = await c.get(PERSISTENT_VOLUME_CLAIMS, "used", ns)
    assert claim is None or claim["metadata"].get("deletionTimestamp")
    pv = await c.get(PERSISTENT_VOLUMES, pv_used)
    assert pv is not None and pv["metadata"].get("deletionTimestamp")
    assert pv["metadata"].get("finalizers") == [PV_PROTECTION]
    await c.delete_pod("user")
    await wait_gone(c, PERSISTENT_VOLUME_CLAIMS, "used", ns, "the used claim gone")
    # The Released PV goes at once (pv-protection does not hold a PV that is not Bound).
    await wait_gone(c, PERSISTENT_VOLUMES, pv_released, None, "the released PV gone")
    # Retain: the claim goes, the PV stays.
    await wait_gone(c, PERSISTENT_VOLUME_CLAIMS, "kept", ns, "the kept PV's claim gone")
    pv = await api.get(PERSISTENT_VOLUMES, pv_kept)
    assert pv["metadata"].get("deletionTimestamp") is None
    # The shared-pool volume and node-b's are untouched, and so are their claims.
    for name, short in ((pv_shared, "shared"), (pv_other, "other")):
        pv = await api.get(PERSISTENT_VOLUMES, name)
        assert pv["metadata"].get("deletionTimestamp") is None, name
        assert PROVISIONER_FINALIZER in pv["metadata"]["finalizers"], name
        claim = await api.get(PERSISTENT_VOLUME_CLAIMS, short, ns)
        assert claim["metadata"].get("deletionTimestamp") is None, short
    assert await c.has_finalizer(node_b), "node-b keeps its finalizer"
    # The claim waiting for node-a is given back to the scheduler; node-b's waits on.
    assert await c.selected_node("waiting-a") is None
    assert await c.selected_node("waiting-b") == node_b

    async def events_written() -> bool:
        return (
            messages.CLAIM_DELETED in await c.events(ns, "used")
            and messages.CLAIM_DELETED in await c.events(ns, "kept")
            and messages.VOLUME_DELETED in await c.events("default", pv_used)
            and messages.VOLUME_DELETED in await c.events("default", pv_released)
            and messages.VOLUME_RETAINED in await c.events("default", pv_kept)
            and messages.NODE_CLEANED_UP in await c.events("default", node_a)
            and messages.CLAIM_RESCHEDULED in await c.events(ns, "waiting-a")
        )

    await eventually_async("the events on the claims, the PVs and the Node", events_written, 10)
    for untouched in ((ns, "shared"), ("default", pv_other), (ns, "waiting-b")):
        assert await c.events(*untouched) == set(), untouched
    after = {a: volumes_cleaned(a) - n for a, n in before.items()}
    assert after == {"claim-deleted": 2, "volume-deleted": 2, "volume-retained": 1, "claim-rescheduled": 1}


def dying_at(step: str, reached: asyncio.Event) -> type[NodeFinalizer]:
    """A node finalizer that hangs for good right after `step` (the write done, nothing after it):
    what the API holds then is what kill -9 at that line leaves."""

    class Dying(NodeFinalizer):
        async def _delete(self, res: Resource, name: str, namespace: str | None, uid: str) -> Obj | None:
            answer = await super()._delete(res, name, namespace, uid)
            if (step, res) in (
                ("claim-deleted", PERSISTENT_VOLUME_CLAIMS),
                ("volume-deleted", PERSISTENT_VOLUMES),
            ):
                reached.set()
                await asyncio.Event().wait()
            return answer

        async def _release(self, node: Obj, how: str) -> None:
            if step == "before-release":
                reached.set()
                await asyncio.Event().wait()
            await super()._release(node, how)

    return Dying


@pytest.mark.parametrize("step", ["claim-deleted", "volume-deleted", "before-release"])
async def test_a_finalizer_killed_at_any_step_converges_on_restart(cluster: Cluster, step: str) -> None:
    c, api, ns = cluster, cluster.api, cluster.ns
    await c.csidriver(attach_required=False)
    reached = asyncio.Event()
    await c.start(dying_at(step, reached))
    node = await c.node("nf-k")
    await eventually_async("the finalizer on the node", lambda: c.has_finalizer(node), 20)
    bound = await c.claim("bound")
    pv_bound = await c.pv("bound", [node], claim=bound)
    pv_released = await c.pv("released", [node], claim_uid=str(uuid.uuid4()), phase="Released")

    await api.delete(NODES, node)
    await asyncio.wait_for(reached.wait(), 30)
    await c.stop_all()
    assert await c.get(NODES, node) is not None, "the Node waits for its finalizer"

    await c.start()
    await eventually_async("the node gone after the restart", lambda: c.gone(NODES, node), 30)
    await wait_gone(c, PERSISTENT_VOLUME_CLAIMS, "bound", ns, "the claim gone")
    # The Released PV goes (pv-protection holds only a Bound one); the Bound one is deleted with
    # only pv-protection left, which kcm lifts once the binder marks it Released.
    await wait_gone(c, PERSISTENT_VOLUMES, pv_released, None, "the released PV gone")
    pv = await api.get(PERSISTENT_VOLUMES, pv_bound)
    assert pv["metadata"].get("deletionTimestamp") and pv["metadata"]["finalizers"] == [PV_PROTECTION]


@pytest.mark.parametrize("mode", ["skip-node-finalize", "shared-mode", "label-mismatch"])
async def test_nothing_is_cleaned_up_when_told_not_to_or_in_shared_mode(cluster: Cluster, mode: str) -> None:
    """--skip-node-finalize, a CSIDriver that requires attach (the shared pool), or a Node whose
    topology label names another node (kubelet writes it: a node must not get another node's
    volumes deleted with its own Node object): the Node still goes, the volumes and claims stay,
    and the Node's event says why."""
    c, api, ns = cluster, cluster.api, cluster.ns
    await c.csidriver(attach_required=mode == "shared-mode")
    await c.start(skip_node_finalize=mode == "skip-node-finalize")
    node = await c.node("nf-s")
    await eventually_async("the finalizer on the node", lambda: c.has_finalizer(node), 20)
    pinned_to = node
    if mode == "label-mismatch":
        pinned_to = c.name("victim")  # a healthy node's value, named by the deleted node's label
        await api.patch(NODES, node, {"metadata": {"labels": {TOPOLOGY_KEY: pinned_to}}})
    bound = await c.claim("bound")
    pv_bound = await c.pv("bound", [pinned_to], claim=bound)

    await api.delete(NODES, node)
    await eventually_async("the node gone", lambda: c.gone(NODES, node), 30)

    async def explained() -> bool:
        return messages.NODE_FINALIZE_SKIPPED in await c.events("default", node)

    await eventually_async("the Node's event", explained, 10)
    pv = await api.get(PERSISTENT_VOLUMES, pv_bound)
    assert pv["metadata"].get("deletionTimestamp") is None
    assert (await api.get(PERSISTENT_VOLUME_CLAIMS, "bound", ns))["metadata"].get("deletionTimestamp") is None


async def start_process(c: Cluster, *flags: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "node_finalizer.main",
        f"--kubeconfig={c.cp.admin_kubeconfig}",
        *flags,
        cwd=REPO_ROOT,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_kill_9_of_the_process_mid_cleanup_converges(cluster: Cluster) -> None:
    """The real process, slowed by its client-side rate limit, SIGKILLed once it has deleted the
    first of twelve claims, and started again: every claim and PV is cleaned up once (no claim is
    reported deleted twice), and the Node goes."""
    c, api, ns = cluster, cluster.api, cluster.ns
    await c.csidriver(attach_required=False)
    node = await c.node("nf-9")
    shorts = [f"v{i}" for i in range(12)]
    pvs = [await c.pv(short, [node], claim=await c.claim(short)) for short in shorts]
    proc = await start_process(c, "--kube-api-qps=4", "--kube-api-burst=1")
    try:
        await eventually_async("the finalizer on the node", lambda: c.has_finalizer(node), 30)
        await api.delete(NODES, node)

        async def one_claim_deleted() -> bool:
            claims = await asyncio.gather(*(c.get(PERSISTENT_VOLUME_CLAIMS, s, ns) for s in shorts))
            return any(claim is None or claim["metadata"].get("deletionTimestamp") for claim in claims)

        await eventually_async("a first claim deleted", one_claim_deleted, 30)
    finally:
        proc.kill()
        await proc.communicate()
    assert await c.get(NODES, node) is not None, "killed before it could finish"

    proc = await start_process(c)
    try:
        await eventually_async("the node gone after the restart", lambda: c.gone(NODES, node), 60)
    finally:
        proc.send_signal(signal.SIGTERM)
        await proc.communicate()
    for short, name in zip(shorts, pvs, strict=True):
        assert await c.gone(PERSISTENT_VOLUME_CLAIMS, short, ns), short
        pv = await api.get(PERSISTENT_VOLUMES, name)
        assert pv["metadata"].get("deletionTimestamp") and pv["metadata"]["finalizers"] == [PV_PROTECTION]
    items = (await api.list_page(EVENTS, ns))["items"]
    told = [e for e in items if e["reason"] == messages.CLAIM_DELETED]
    assert all(e.get("count", 1) == 1 for e in told)
    assert len({e["involvedObject"]["name"] for e in told}) == len(told), "a claim reported deleted twice"


async def test_the_process_serves_health_metrics_json_logs_and_stops_on_sigterm(cluster: Cluster) -> None:
    """`kubeloop-node-finalizer` itself, with leader election: ready once it leads and its cache is
    synced, its counters on /metrics, JSON logs, and on SIGTERM a clean exit that
    releases its Lease."""
    c, api = cluster, cluster.api
    await c.csidriver(attach_required=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = await start_process(
        c, f"--http-endpoint=127.0.0.1:{port}", "--leader-election", "--log-format=json"
    )
    try:
        node = await c.node("nf-p")
        await eventually_async("the finalizer on the node", lambda: c.has_finalizer(node), 30)
        await api.delete(NODES, node)
        await eventually_async("the node gone", lambda: c.gone(NODES, node), 30)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/readyz") as rsp:
                assert rsp.status == 200, await rsp.text()
            async with http.get(f"http://127.0.0.1:{port}/metrics") as rsp:
                metrics = await rsp.text()
        assert 'kubeloop_node_finalizer_nodes_finalized_total{cleanup="done"} 1.0' in metrics
        assert "# TYPE kubeloop_node_finalizer_volumes_cleaned_total counter" in metrics
        lease = await api.get(LEASES, "kubeloop-node-finalizer", "kube-system")
        assert lease["spec"].get("holderIdentity")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    logs = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    assert any(entry.get("msg") == "removed finalizer, the node can go" for entry in logs), logs
    lease = await api.get(LEASES, "kubeloop-node-finalizer", "kube-system")
    assert not lease["spec"].get("holderIdentity"), "the Lease is released on SIGTERM"


async def test_a_stale_cached_node_is_never_finalized(cluster: Cluster) -> None:
    """A cached Node that says 'deleting, finalizer on' is checked against the API first: the live
    Node not being deleted, or being another Node of the same name (another UID), means nothing is
    finalized (a lagging cache must not clean up a live node's volumes)."""
    c, api = cluster, cluster.api
    await c.csidriver(attach_required=False)
    finalizer = await c.start()
    node = await c.node("nf-l")
    await eventually_async("the finalizer on the node", lambda: c.has_finalizer(node), 20)
    live = await api.get(NODES, node)
    deleting = copy.deepcopy(live)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert await finalizer._live(deleting) is None, "the live Node is not being deleted"
    await api.delete(NODES, node)
    other = copy.deepcopy(deleting)
    other["metadata"]["uid"] = str(uuid.uuid4())
    assert await finalizer._live(other) is None, "another Node of the same name"
