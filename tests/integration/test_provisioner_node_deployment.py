"""Distributed provisioning against the real apiserver: two nodes, each with its own CSI driver
(`--mode all --node-local`, its own pool) and its own external-provisioner with
`--node-deployment` (NODE_NAME), as upstream deploys it for node-local storage. The pv-controller
completes the binds.

- a WaitForFirstConsumer claim selected for node-b is provisioned by node-b's provisioner alone;
- 20 Immediate claims at once are each provisioned exactly once (one PV, one CreateVolume across
  both drivers), the nodes electing an owner per claim with short delays;
- a Released PV is deleted only by the provisioner of the node it lives on;
- each node publishes CSIStorageCapacity for its own segment, owned by its pod
  (--capacity-ownerref-level=0, garbage-collected with it) or by nobody (-1).

Each CreateVolume is counted from the provisioners' own csi_sidecar_operations_seconds, the metric
the Go sidecar exports.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp
import pytest

from controller_runtime import storage
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.resources import (
    CSI_NODES,
    CSI_STORAGE_CAPACITIES,
    EVENTS,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PODS,
    Obj,
    Resource,
)
from controller_runtime.toolchain import REPO_ROOT
from csi_driver import DRIVER_NAME, TOPOLOGY_KEY
from external_provisioner import names
from localstack.controlplane import ControlPlane
from localstack.proc import free_ports
from tests.csi.conftest import Driver
from tests.integration.provisioner_harness import terminate
from tests.support.waits import consistently_async, eventually_async, no_problems

from .provisioner_harness import IDENTITY, Harness, create_topology_node, kubectl

pytestmark = pytest.mark.integration

SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount", True)
ROLES = Resource("rbac.authorization.k8s.io", "v1", "roles", "Role", True)
ROLE_BINDINGS = Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True)
CREATE_VOLUME = "/csi.v1.Controller/CreateVolume"
DELETE_VOLUME = "/csi.v1.Controller/DeleteVolume"


class NodeSide:
    """One node: its driver on its own pool, and its node-deployment provisioner."""

    def __init__(self, h: Harness, short: str, driver_args: Sequence[str] = ()) -> None:
        self.h = h
        self.name = f"{h.ns}-{short}"
        self.root = h.root / short
        # A node-local pool must exist before its plugin starts (an unmounted disk is not replaced).
        (self.root / "pool").mkdir(parents=True)
        self.driver = Driver(self.root, "all", self.name, ["--node-local", *driver_args])
        self.log = self.root / "provisioner.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.port = 0

    async def start(self, *extra: str, env: dict[str, str] | None = None) -> None:
        (self.port,) = free_ports(1)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "external_provisioner.main",
            f"--kubeconfig={self.h.cp.kubeconfig_for(IDENTITY)}",
            f"--csi-address={self.driver.endpoint}",
            f"--state-dir={self.root / 'provisioner'}",
            f"--http-endpoint=127.0.0.1:{self.port}",
            "--retry-interval-start=100ms",
            "--retry-interval-max=1s",
            "--kube-api-qps=100",
            "--kube-api-burst=200",
            "--node-deployment",
            "--capacity-ownerref-level=-1",
            "-v=4",
            *extra,
            cwd=REPO_ROOT,
            env={**os.environ, "NODE_NAME": self.name, **(env or {})},
            stdout=self.log.open("ab"),
            stderr=asyncio.subprocess.STDOUT,
        )
        await self.wait_ready()

    async def wait_ready(self, timeout: float = 30) -> None:
        async def ready() -> list[str]:
            assert self.proc is not None
            assert self.proc.returncode is None, f"provisioner exited\n{self.log_tail()}"
            with contextlib.suppress(aiohttp.ClientError):
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(f"http://127.0.0.1:{self.port}/readyz") as rsp,
                ):
                    if rsp.status == 200:
                        return []
            return ["not ready"]

        await eventually_async("ready", ready, timeout, 0.1, satisfied=no_problems, context=self.log_tail)

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        await self.proc.wait()
        self.proc = None

    async def stop(self) -> None:
        await terminate(self.proc)
        self.proc = None

    async def calls(self, method: str) -> int:
        """How many times this provisioner called `method` on its driver, by its metrics."""
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{self.port}/metrics") as rsp,
        ):
            text = await rsp.text()
        total = 0.0
        for line in text.splitlines():
            if line.startswith("csi_sidecar_operations_seconds_count{") and f'method_name="{method}"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def backing_files(self) -> set[str]:
        pool = self.driver.pool / "volumes"
        return {p.name.removesuffix(".img") for p in pool.glob("*.img")} if pool.exists() else set()

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


@contextlib.asynccontextmanager
async def two_nodes(
    cp: ControlPlane,
    api: ApiClient,
    namespace: str,
    *extra: str,
    start: bool = True,
    driver_a: Sequence[str] = (),
    driver_b: Sequence[str] = (),
) -> AsyncIterator[tuple[Harness, NodeSide, NodeSide]]:
    """Nodes a and b (Node and CSINode objects, as their kubelets would register them), each
    with its driver (with `driver_a`, `driver_b` added) and, unless `start` is false, its
    provisioner; the pv-controller in-process."""
    h = Harness(cp, api, namespace)
    sides = [NodeSide(h, "a", driver_a), NodeSide(h, "b", driver_b)]
    try:
        await kubectl(cp, "apply", "-f", str(REPO_ROOT / "deploy/rbac/external-provisioner.yaml"))
        for side in sides:
            await create_topology_node(api, side.name)
            side.driver.start()
        await h.start_pv_controller()
        if start:
            for side in sides:
                await side.start(*extra)
        yield h, sides[0], sides[1]
    finally:
        for side in sides:
            await side.stop()
        await h.cleanup()
        for side in sides:
            side.driver.stop()
            for res in (CSI_NODES, NODES):
                with contextlib.suppress(ApiError):
                    await api.delete(res, side.name)


def affinity_nodes(pv: Obj) -> list[str]:
    terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    return [v for t in terms for e in t["matchExpressions"] if e["key"] == TOPOLOGY_KEY for v in e["values"]]


async def grant_capacity(api: ApiClient, namespace: str) -> None:
    """In the test's namespace the provisioner may read pods and keep capacity objects (in a
    cluster deploy/rbac grants both in the driver's namespace)."""
    await api.create(
        ROLES,
        {
            "metadata": {"name": "capacity"},
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
                {
                    "apiGroups": ["storage.k8s.io"],
                    "resources": ["csistoragecapacities"],
                    "verbs": ["get", "list", "watch", "create", "update", "delete"],
                },
            ],
        },
        namespace,
    )
    await api.create(
        ROLE_BINDINGS,
        {
            "metadata": {"name": "capacity"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "capacity"},
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": IDENTITY.user.rsplit(":", 1)[1],
                    "namespace": "kube-system",
                }
            ],
        },
        namespace,
    )


async def test_a_scheduled_claim_is_provisioned_by_its_node_alone(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with two_nodes(control_plane, api, namespace, "--strict-topology") as (h, a, b):
        cls = await h.create_class("wffc", volumeBindingMode="WaitForFirstConsumer")
        # The scheduler's decision, written as it writes it.
        await h.create_pvc("data", "16Mi", cls, annotations={storage.ANN_SELECTED_NODE: b.name})
        pv = (await h.bound("data", timeout=30))["data"]
        assert affinity_nodes(pv) == [b.name]
        handle = pv["spec"]["csi"]["volumeHandle"]
        assert b.backing_files() == {handle} and not a.backing_files()
        assert pv["spec"]["csi"]["volumeAttributes"][names.PROVISIONER_IDENTITY].endswith(f"-{b.name}")
        assert (await a.calls(CREATE_VOLUME), await b.calls(CREATE_VOLUME)) == (0, 1)
        # Node a's provisioner never spoke about the claim: one Provisioning event, node b's.
        provisioning = [m for r, m in await h.events("data") if r == names.PROVISIONING]
        assert len(provisioning) == 1, await h.events("data")

        # A claim selected for a node no provisioner runs on stays Pending, silently.
        await h.create_pvc("elsewhere", "16Mi", cls, annotations={storage.ANN_SELECTED_NODE: "nowhere"})
        ours = (names.PROVISIONING, storage.PROVISIONING_FAILED)

        async def silent() -> list[str]:
            claim = await h.pvc("elsewhere")
            phase = claim["status"]["phase"] if claim is not None else None
            said = [e for e in await h.events("elsewhere") if e[0] in ours]
            return ([f"phase {phase}"] if phase != "Pending" else []) + [f"event {e}" for e in said]

        await consistently_async(
            "the claim for node nowhere Pending, silently", silent, 1.5, satisfied=no_problems
        )


async def test_a_clone_scheduled_away_from_its_source_is_given_back_to_the_scheduler(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """A clone whose pod the scheduler placed on another node than the source's: that node's
    driver does not hold the source (NOT_FOUND naming the cause), which in node deployment means
    another node's pool may, so its provisioner says so and removes selected-node (read as final,
    as upstream does, it left the claim pinned to the wrong node for good); the scheduler's next
    choice, the source's node, makes it there."""
    async with two_nodes(control_plane, api, namespace, "--strict-topology") as (h, a, b):
        cls = await h.create_class("wffc", volumeBindingMode="WaitForFirstConsumer")
        await h.create_pvc("source", "16Mi", cls, annotations={storage.ANN_SELECTED_NODE: a.name})
        await h.bound("source", timeout=30)
        source = {"kind": "PersistentVolumeClaim", "name": "source"}
        await h.create_pvc(
            "copy", "16Mi", cls, data_source=source, annotations={storage.ANN_SELECTED_NODE: b.name}
        )
        await h.wait_event(
            "copy", storage.PROVISIONING_FAILED, "cloned and restored on the node that holds the source"
        )

        async def given_back() -> list[str]:
            claim = await h.pvc("copy")
            selected = ((claim or {}).get("metadata", {}).get("annotations") or {}).get(
                storage.ANN_SELECTED_NODE
            )
            return (
                [f"selected-node is still {selected}; events: {await h.events('copy')}"] if selected else []
            )

        await eventually_async("the selected node given back", given_back, 20, 0.1, satisfied=no_problems)
        await api.patch(
            PERSISTENT_VOLUME_CLAIMS,
            "copy",
            {"metadata": {"annotations": {storage.ANN_SELECTED_NODE: a.name}}},
            namespace,
        )
        pv = (await h.bound("copy", timeout=30))["copy"]
        assert affinity_nodes(pv) == [a.name]
        assert pv["spec"]["csi"]["volumeHandle"] in a.backing_files() and not b.backing_files()


async def test_an_immediate_clone_is_won_by_the_node_holding_its_source(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """Immediate clones: only the node whose driver holds the source competes (kubeloop
    extension; upstream lets any node win, and the winner's CreateVolume is NOT_FOUND), so each
    copy is made once, on the source's node, and no provisioner writes ProvisioningFailed (the
    pv-controller may, as kcm's does, while its class informer has not yet seen the new class)."""
    delays = ("--node-deployment-base-delay=300ms", "--node-deployment-max-delay=1s")
    async with two_nodes(control_plane, api, namespace, *delays) as (h, a, b):
        wffc = await h.create_class("wffc", volumeBindingMode="WaitForFirstConsumer")
        await h.create_pvc("source", "16Mi", wffc, annotations={storage.ANN_SELECTED_NODE: b.name})
        await h.bound("source", timeout=30)
        now = await h.create_class("now", volumeBindingMode="Immediate")
        source = {"kind": "PersistentVolumeClaim", "name": "source"}
        copies = [f"copy{i}" for i in range(4)]
        await asyncio.gather(*(h.create_pvc(c, "16Mi", now, data_source=source) for c in copies))
        pvs = await h.bound(*copies, timeout=60)
        assert all(affinity_nodes(pv) == [b.name] for pv in pvs.values())
        assert not a.backing_files() and len(b.backing_files()) == 5
        assert (await a.calls(CREATE_VOLUME), await b.calls(CREATE_VOLUME)) == (0, 5)
        for c in copies:
            events = await h.events(c, component_prefix=f"{DRIVER_NAME}_")
            assert not [e for e in events if e[0] == storage.PROVISIONING_FAILED]


async def test_immediate_claims_are_each_provisioned_exactly_once(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    delays = ("--node-deployment-base-delay=300ms", "--node-deployment-max-delay=1s")
    async with two_nodes(control_plane, api, namespace, *delays) as (h, a, b):
        cls = await h.create_class("now", volumeBindingMode="Immediate")
        claims = [f"c{i}" for i in range(20)]
        await asyncio.gather(*(h.create_pvc(c, "8Mi", cls) for c in claims))
        pvs = await h.bound(*claims, timeout=90)
        handles = {pv["spec"]["csi"]["volumeHandle"] for pv in pvs.values()}
        assert len(handles) == 20 and len(await h.pvs()) == 20
        on_a, on_b = a.backing_files(), b.backing_files()
        assert on_a | on_b == handles and not on_a & on_b
        for claim, pv in pvs.items():
            selected = (await h.pvc(claim) or {})["metadata"]["annotations"][storage.ANN_SELECTED_NODE]
            assert affinity_nodes(pv) == [selected]
            assert pv["spec"]["csi"]["volumeHandle"] in (on_a if selected == a.name else on_b)
        assert await a.calls(CREATE_VOLUME) + await b.calls(CREATE_VOLUME) == 20
        assert (await a.calls(CREATE_VOLUME), await b.calls(CREATE_VOLUME)) == (len(on_a), len(on_b))


async def test_a_provisioner_killed_during_an_election_burst_converges(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """kill -9 of node a's provisioner while 12 Immediate claims are being elected and provisioned,
    then a restart: every claim gets one volume, and the two pools hold exactly the PVs' volumes."""
    delays = ("--node-deployment-base-delay=500ms", "--node-deployment-max-delay=2s")
    async with two_nodes(control_plane, api, namespace, *delays) as (h, a, b):
        cls = await h.create_class("now", volumeBindingMode="Immediate")
        claims = [f"c{i}" for i in range(12)]
        await asyncio.gather(*(h.create_pvc(c, "8Mi", cls) for c in claims))
        await asyncio.sleep(0.4)
        await a.kill()
        await asyncio.sleep(1.0)
        await a.start(*delays)
        pvs = await h.bound(*claims, timeout=90)
        handles = {pv["spec"]["csi"]["volumeHandle"] for pv in pvs.values()}
        assert len(handles) == 12 and len(await h.pvs()) == 12

        async def exact() -> list[str]:
            on_a, on_b = a.backing_files(), b.backing_files()
            if on_a & on_b or on_a | on_b != handles:
                return [f"pools a {sorted(on_a)} b {sorted(on_b)} != PVs {sorted(handles)}"]
            return []

        await eventually_async("exact", exact, 20, satisfied=no_problems, context=a.log_tail)


async def test_a_node_without_room_leaves_immediate_claims_to_one_with_room(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """Each node asks its driver's GetCapacity before it tries to own a claim, as upstream: node
    a, whose pool offers 8Mi, takes none of the 16Mi claims, and no claim fails there first."""
    delays = ("--node-deployment-base-delay=300ms", "--node-deployment-max-delay=1s")
    async with two_nodes(control_plane, api, namespace, *delays, driver_a=["--capacity=8Mi"]) as (h, a, b):
        cls = await h.create_class("now", volumeBindingMode="Immediate")
        claims = [f"c{i}" for i in range(5)]
        await asyncio.gather(*(h.create_pvc(c, "16Mi", cls) for c in claims))
        pvs = await h.bound(*claims, timeout=60)
        assert all(affinity_nodes(pv) == [b.name] for pv in pvs.values())
        assert not a.backing_files() and len(b.backing_files()) == 5
        assert (await a.calls(CREATE_VOLUME), await b.calls(CREATE_VOLUME)) == (0, 5)
        for c in claims:
            events = await h.events(c, component_prefix=f"{DRIVER_NAME}_")
            assert not [e for e in events if e[0] == storage.PROVISIONING_FAILED]


async def test_a_class_naming_a_pool_kind_no_node_has_says_so_on_the_class(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """A WaitForFirstConsumer class whose `kind` no node's pool offers: no capacity is published
    for it, so the scheduler only says "did not have enough free storage"; each node's
    provisioner puts the driver's reason on the class instead, and publishes the kinds it has."""
    capacity = ("--enable-capacity", f"--capacity-namespace={namespace}", "--capacity-poll-interval=1s")
    kinds = ["--capacity=fast=64Mi", "--capacity=slow=128Mi"]
    await grant_capacity(api, namespace)
    async with two_nodes(control_plane, api, namespace, *capacity, driver_a=kinds, driver_b=kinds) as (
        h,
        a,
        b,
    ):
        bad = await h.create_class(
            "tape", volumeBindingMode="WaitForFirstConsumer", parameters={"kind": "tape"}
        )
        good = await h.create_class(
            "fast", volumeBindingMode="WaitForFirstConsumer", parameters={"kind": "fast"}
        )

        async def warned() -> list[str]:
            items = (await api.list_page(EVENTS, "default"))["items"]
            found = {
                e["source"].get("host", "") + ": " + e["message"]
                for e in items
                if e["involvedObject"].get("name") == bad and e["reason"] == names.REASON_CAPACITY_FAILED
            }
            return [] if len(found) == 2 and all("tape" in m for m in found) else [f"events {sorted(found)}"]

        await eventually_async(
            "warned", warned, 20, satisfied=no_problems, context=lambda: a.log_tail() + b.log_tail()
        )
        published = (await api.list_page(CSI_STORAGE_CAPACITIES, namespace))["items"]
        assert {o["storageClassName"] for o in published} == {good}
        assert {o["capacity"] for o in published} == {"64Mi"}


async def test_a_volume_is_deleted_by_its_own_node_only(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with two_nodes(control_plane, api, namespace) as (h, a, b):
        cls = await h.create_class("wffc", volumeBindingMode="WaitForFirstConsumer")
        await h.create_pvc("on-a", "16Mi", cls, annotations={storage.ANN_SELECTED_NODE: a.name})
        pv = (await h.bound("on-a", timeout=30))["on-a"]
        name, handle = pv["metadata"]["name"], pv["spec"]["csi"]["volumeHandle"]
        assert a.backing_files() == {handle}

        # Without node a's provisioner the Released PV stays: node b's leaves it alone, silently.
        await a.stop()
        await h.delete_claims()

        async def released() -> list[str]:
            phase = ((await h.pv(name)) or {}).get("status", {}).get("phase")
            return [] if phase == "Released" else [f"PV {name}: {phase}"]

        await eventually_async("released", released, 20, satisfied=no_problems)

        async def left_alone() -> list[str]:
            problems = [] if await h.pv(name) is not None else [f"PV {name} gone"]
            if a.backing_files() != {handle}:
                problems.append(f"node a's files {a.backing_files()}")
            if deletes := await b.calls(DELETE_VOLUME):
                problems.append(f"{deletes} DeleteVolume calls on node b")
            failed = [e for e in await h.events(name) if e[0] == storage.VOLUME_FAILED_DELETE]
            return problems + [f"event {e}" for e in failed]

        await consistently_async(
            "the Released PV left alone by node b", left_alone, 1.5, satisfied=no_problems
        )

        # Node a's provisioner back: its volume goes, PV and backing file.
        await a.start()

        async def gone() -> list[str]:
            problems = [] if await h.pv(name) is None else [f"PV {name} still there"]
            return problems + ([f"backing file {handle} still there"] if a.backing_files() else [])

        await eventually_async("gone", gone, 30, satisfied=no_problems, context=a.log_tail)
        # (DeleteVolume may be repeated by a sync that saw the PV before its finalizer went: idempotent.)
        assert await a.calls(DELETE_VOLUME) >= 1 and await b.calls(DELETE_VOLUME) == 0


async def test_each_node_publishes_its_own_capacity_owned_by_its_pod_or_by_nobody(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    b_pool = ["--capacity=64Mi"]
    async with two_nodes(control_plane, api, namespace, start=False, driver_b=b_pool) as (h, a, b):
        await grant_capacity(api, namespace)

        # A pod needs its namespace's default ServiceAccount, which kcm makes just after the namespace.
        async def account() -> list[str]:
            try:
                await api.get(SERVICE_ACCOUNTS, "default", namespace)
            except ApiError as exc:
                return [exc.message]
            return []

        await eventually_async("account", account, 20, satisfied=no_problems)
        pod = await api.create(
            PODS,
            {
                "metadata": {"name": "provisioner-a"},
                # No scheduler picks it up (and no kubelet would run it): deleting it is immediate.
                "spec": {
                    "schedulerName": "nobody",
                    "containers": [{"name": "c", "image": "kubeloop/kubeloop:0.1.0"}],
                },
            },
            namespace,
        )
        cls = await h.create_class("wffc", volumeBindingMode="WaitForFirstConsumer")
        capacity = ("--enable-capacity", f"--capacity-namespace={namespace}", "--capacity-poll-interval=1s")
        await a.start(
            *capacity,
            "--capacity-ownerref-level=0",
            env={"POD_NAME": "provisioner-a", "NAMESPACE": namespace},
        )
        # Node b polls once an hour: what changes its object below is its own provisioning.
        await b.start(*capacity[:2], "--capacity-poll-interval=1h")

        async def objects() -> dict[str, Obj]:
            items = (await api.list_page(CSI_STORAGE_CAPACITIES, namespace))["items"]
            return {i["metadata"]["labels"][names.CAPACITY_LABEL_MANAGED_BY]: i for i in items}

        async def both() -> list[str]:
            found = await objects()
            wanted = {f"external-provisioner-{s.name}" for s in (a, b)}
            return [] if set(found) == wanted else [f"managed-by {sorted(found)}"]

        await eventually_async(
            "both", both, 20, satisfied=no_problems, context=lambda: a.log_tail() + b.log_tail()
        )
        found = await objects()
        for side in (a, b):
            obj = found[f"external-provisioner-{side.name}"]
            assert obj["storageClassName"] == cls
            assert obj["nodeTopology"] == {"matchLabels": {TOPOLOGY_KEY: side.name}}
            assert obj["metadata"]["labels"][names.CAPACITY_LABEL_DRIVER] == DRIVER_NAME
            assert obj["metadata"]["generateName"] == "csisc-"
        refs = found[f"external-provisioner-{a.name}"]["metadata"]["ownerReferences"]
        assert refs == [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": "provisioner-a",
                "uid": pod["metadata"]["uid"],
                "controller": True,
            }
        ]
        assert "ownerReferences" not in found[f"external-provisioner-{b.name}"]["metadata"]
        assert found[f"external-provisioner-{b.name}"]["capacity"] == "64Mi"
        uids = {k: v["metadata"]["uid"] for k, v in found.items()}

        async def same_objects() -> dict[str, str]:
            return {k: v["metadata"]["uid"] for k, v in (await objects()).items()}

        # A few polls: still one object per node, not a new one each time.
        await consistently_async(
            "one object per node", same_objects, 2.5, 0.2, satisfied=lambda now: now == uids
        )

        # A volume made on node b is taken off its published capacity at once, not at the next poll
        # (upstream's provision wrapper), so the scheduler does not send claims to a full pool.
        await h.create_pvc("data", "16Mi", cls, annotations={storage.ANN_SELECTED_NODE: b.name})
        await h.bound("data", timeout=30)

        async def shrunk() -> list[str]:
            left = (await objects())[f"external-provisioner-{b.name}"]["capacity"]
            return [] if left == "48Mi" else [f"node b publishes {left}"]

        await eventually_async("shrunk", shrunk, 10, satisfied=no_problems, context=b.log_tail)

        # The pod's objects go with it (the garbage collector), node b's stay.
        await a.stop()
        await api.delete(PODS, "provisioner-a", namespace)

        async def collected() -> list[str]:
            left = set(await objects())
            return [] if left == {f"external-provisioner-{b.name}"} else [f"left {sorted(left)}"]

        await eventually_async("collected", collected, 30, satisfied=no_problems)


async def test_node_deployment_refuses_to_start_without_its_node_or_its_pod(
    control_plane: ControlPlane, api: ApiClient, namespace: str, tmp_path: Path
) -> None:
    """Without NODE_NAME, with --leader-election (one Lease would leave one node serving all), or
    with a capacity owner but no POD_NAME or the objects outside the pod's namespace, the process
    exits at once (upstream's messages where it has them), before it connects to anything."""
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "POD_NAME", "NAMESPACE")}
    node = {**env, "NODE_NAME": "n"}
    cases: Sequence[tuple[list[str], dict[str, str], str]] = (
        ([], env, "The NODE_NAME environment variable must be set when using --node-deployment."),
        (["--leader-election"], node, "--leader-election cannot be used with --node-deployment"),
        (["--enable-capacity"], node, "need POD_NAME env variable to determine CSIStorageCapacity owner"),
        (
            ["--enable-capacity", "--capacity-namespace=elsewhere"],
            {**node, "POD_NAME": "p", "NAMESPACE": "kube-system"},
            "needs the CSIStorageCapacity objects in the pod's namespace 'kube-system', not 'elsewhere'",
        ),
    )
    for flags, environ, message in cases:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "external_provisioner.main",
            f"--kubeconfig={control_plane.kubeconfig_for(IDENTITY)}",
            f"--csi-address=unix://{tmp_path / 'none.sock'}",
            "--node-deployment",
            *flags,
            cwd=REPO_ROOT,
            env=environ,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 1 and message in out.decode(), out.decode()
