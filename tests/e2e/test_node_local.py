"""Node-local pools end to end (issue 31; `make up --pools node-local`): the node-local registry's
processes against the session's real kube-apiserver, kube-controller-manager and kube-scheduler. On
each of node-a and node-b: the CSI driver `--mode all --node-local` on its own pool, an
external-provisioner and an external-resizer in node deployment, a node agent as its kubelet;
centrally the pv-controller, the attach-detach and volume-expand controllers. Pods are placed by
the real scheduler (no nodeName), which weighs the CSIStorageCapacity objects each node's
provisioner publishes.

What is checked in each test is where the bytes are: the backing files in each node's pool, the
PVs' node affinity, the absence of VolumeAttachments, checksums through the pod's mount."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.quantity import parse_quantity
from controller_runtime.resources import (
    CSI_STORAGE_CAPACITIES,
    EVENTS,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    STORAGE_CLASSES,
    VOLUME_ATTACHMENTS,
    Obj,
)
from csi_driver import DRIVER_NAME, TOPOLOGY_KEY
from localstack.controlplane import ControlPlane
from localstack.pools import NODE_LOCAL, PoolCapacity
from localstack.proc import RestartPolicy
from localstack.storage_stack import NODES as NODE_NAMES
from localstack.storage_stack import StorageStack
from tests.support.waits import consistently_async, eventually_async, no_problems

pytestmark = [pytest.mark.integration, pytest.mark.root]

MI = 1 << 20
IMMEDIATE = "kubeloop"  # deploy/storageclasses.yaml, applied with the provisioners
WFFC = "kubeloop-wffc"
# xfs: online ext4 growth needs CAP_SYS_RESOURCE, which a sandbox may lack (test_expansion.py).
XFS = "kubeloop-node-local-xfs"
POOL = "1Gi"  # each node's pool
COMPONENTS = (
    "pv-controller",
    "csi-driver-node",
    "external-provisioner",
    "node-agent",
    "attach-detach-controller",
    "volume-expand-controller",
    "external-resizer",
    "node-finalizer",
)
FINALIZER = "loop.csi.kubeloop.dev/node"  # the node finalizer's, on every Node
CAPACITY_NAMESPACE = "kube-system"  # where the provisioners publish (their --capacity-namespace)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(control_plane: ControlPlane, api: ApiClient) -> AsyncIterator[StorageStack]:
    s = StorageStack(
        control_plane,
        api,
        COMPONENTS,
        pools=NODE_LOCAL,
        pool_capacity=PoolCapacity(default=POOL),
        restart=RestartPolicy(initial=0.5, cap=2.0),
    )
    xfs = {
        "metadata": {"name": XFS},
        "provisioner": DRIVER_NAME,
        "parameters": {"csi.storage.k8s.io/fstype": "xfs"},
        "volumeBindingMode": "WaitForFirstConsumer",
        "allowVolumeExpansion": True,
    }
    await api.create(STORAGE_CLASSES, xfs)
    try:
        await s.start()
        for class_name in (WFFC, XFS):
            published = functools.partial(capacities, api, class_name)
            await eventually_async(f"each node's capacity for {class_name}", published, 60)
        yield s
    finally:
        await s.stop()
        await api.delete(STORAGE_CLASSES, XFS)  # its capacity objects went with the stack


# -- helpers -----------------------------------------------------------------------------------------


async def capacities(api: ApiClient, class_name: str) -> dict[str, int] | None:
    """Each node's published capacity for the class, once both nodes have one."""
    items, _ = await api.list_all(CSI_STORAGE_CAPACITIES, CAPACITY_NAMESPACE)
    out: dict[str, int] = {}
    for item in items:
        labels = (item.get("nodeTopology") or {}).get("matchLabels") or {}
        if item.get("storageClassName") == class_name and TOPOLOGY_KEY in labels:
            out[labels[TOPOLOGY_KEY]] = parse_quantity(item.get("capacity", "0"))
    return out if set(out) == set(NODE_NAMES) else None


async def claim(api: ApiClient, namespace: str, size: str, class_name: str, name: str = "") -> str:
    name = name or f"c-{uuid.uuid4().hex[:8]}"
    await api.create(
        PERSISTENT_VOLUME_CLAIMS,
        {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": class_name,
                "resources": {"requests": {"storage": size}},
            },
        },
    )
    return name


async def pod(api: ApiClient, namespace: str, name: str, claim_name: str, node: str = "") -> Obj:
    """A pod the real scheduler places (`node` only as a nodeSelector on the driver's topology
    label, which each node agent puts on its Node from NodeGetInfo, as kubelet does)."""
    spec: Obj = {
        "terminationGracePeriodSeconds": 5,
        "containers": [
            {
                "name": "app",
                "image": "registry.k8s.io/pause:3.10",
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            }
        ],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim_name}}],
    }
    if node:
        spec["nodeSelector"] = {TOPOLOGY_KEY: node}
    return await api.create(PODS, {"metadata": {"name": name, "namespace": namespace}, "spec": spec})


async def running(api: ApiClient, namespace: str, name: str, timeout: float = 90) -> Obj:
    async def check() -> Obj | None:
        p = await api.get(PODS, name, namespace)
        return p if p.get("status", {}).get("phase") == "Running" else None

    found: Obj = await eventually_async(f"pod {namespace}/{name} Running", check, timeout, 0.2)
    return found


async def delete_pod(api: ApiClient, namespace: str, name: str) -> None:
    await api.delete(PODS, name, namespace)
    await eventually_async(f"pod {name} gone", lambda: gone(api, PODS, name, namespace), 90, 0.2)


async def gone(api: ApiClient, res: object, name: str, namespace: str | None = None) -> bool:
    try:
        await api.get(res, name, namespace)  # type: ignore[arg-type]
    except ApiError as exc:
        if exc.not_found:
            return True
        raise
    return False


async def bound_volume(api: ApiClient, namespace: str, name: str, timeout: float = 90) -> Obj:
    async def check() -> Obj | None:
        pvc = await api.get(PERSISTENT_VOLUME_CLAIMS, name, namespace)
        if pvc.get("status", {}).get("phase") != "Bound":
            return None
        pv: Obj = await api.get(PERSISTENT_VOLUMES, pvc["spec"]["volumeName"])
        return pv

    pv: Obj = await eventually_async(f"claim {name} Bound", check, timeout, 0.2)
    return pv


def handle_of(pv: Obj) -> str:
    return str(pv["spec"]["csi"]["volumeHandle"])


def affinity_nodes(pv: Obj) -> list[list[str]]:
    """The nodes each term of the PV's required node affinity names through the topology key."""
    terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    out = []
    for term in terms:
        exprs = term.get("matchExpressions") or []
        assert [e["key"] for e in exprs] == [TOPOLOGY_KEY], f"a term on other keys: {term}"
        out.append(list(exprs[0]["values"]))
    return out


def backing_files(stack: StorageStack) -> dict[str, list[str]]:
    """Volume id -> the nodes whose pool holds a backing file for it."""
    out: dict[str, list[str]] = {}
    for node in NODE_NAMES:
        volumes = stack.node_pool(node) / "volumes"
        for f in volumes.glob("*.img") if volumes.is_dir() else []:
            out.setdefault(f.name.removesuffix(".img"), []).append(node)
    return out


async def volumes_of(api: ApiClient, namespace: str) -> list[Obj]:
    """The PVs bound or being bound to claims of the namespace."""
    items, _ = await api.list_all(PERSISTENT_VOLUMES)
    return [pv for pv in items if (pv["spec"].get("claimRef") or {}).get("namespace") == namespace]


async def attachments_of(api: ApiClient, pv_name: str) -> list[Obj]:
    items, _ = await api.list_all(VOLUME_ATTACHMENTS)
    return [va for va in items if va["spec"]["source"].get("persistentVolumeName") == pv_name]


def write_data(mount: Path, size: int = MI) -> str:
    data = os.urandom(size)
    with open(mount / "data.bin", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def checksum(mount: Path) -> str:
    return hashlib.sha256((mount / "data.bin").read_bytes()).hexdigest()


async def delete_claims_and_wait(stack: StorageStack, namespace: str, names: list[str]) -> None:
    """Deletes the claims and waits for their PVs and backing files to go (reclaim policy Delete:
    the provisioner of the volume's node deletes it)."""
    pvs: list[Obj] = []
    for name in names:
        pvc = await stack.api.get(PERSISTENT_VOLUME_CLAIMS, name, namespace)
        if pvc["spec"].get("volumeName"):
            pvs.append(await stack.api.get(PERSISTENT_VOLUMES, pvc["spec"]["volumeName"]))
        await stack.api.delete(PERSISTENT_VOLUME_CLAIMS, name, namespace)
    for pv in pvs:
        name = pv["metadata"]["name"]
        await eventually_async(
            f"PV {name} gone", functools.partial(gone, stack.api, PERSISTENT_VOLUMES, name), 120
        )
    handles = {handle_of(pv) for pv in pvs}

    async def files_gone() -> bool:
        return not handles & set(backing_files(stack))

    await eventually_async("the backing files deleted", files_gone, 60)


async def labelled(api: ApiClient, name: str) -> bool:
    """The Node is there with its plugin's topology label (its agent registered the plugin)."""
    try:
        node = await api.get(NODES, name)
    except ApiError as exc:
        if exc.not_found:
            return False
        raise
    return bool((node["metadata"].get("labels") or {}).get(TOPOLOGY_KEY) == name)


# kube-scheduler's VolumeBinding message for a node without CSIStorageCapacity room for a claim.
NO_ROOM = "did not have enough free storage"


async def scheduler_says(
    api: ApiClient, namespace: str, pod_name: str, text: str, timeout: float = 60
) -> None:
    """Until a FailedScheduling event of the pod says `text` (an earlier attempt may have failed for
    another reason, e.g. a claim the scheduler's cache had not seen yet)."""

    async def said() -> bool:
        events = await events_for(api, namespace, pod_name, "FailedScheduling")
        return any(text in e["message"] for e in events)

    try:
        await eventually_async(f"FailedScheduling of {pod_name} saying {text!r}", said, timeout, 0.5)
    except AssertionError as exc:
        seen = [e["message"] for e in await events_for(api, namespace, pod_name, "FailedScheduling")]
        raise AssertionError(f"{exc}; its FailedScheduling messages: {seen}") from None


async def events_for(api: ApiClient, namespace: str, name: str, reason: str) -> list[Obj]:
    items, _ = await api.list_all(EVENTS, namespace)
    return [e for e in items if e["involvedObject"]["name"] == name and e.get("reason") == reason]


# -- (a) WaitForFirstConsumer: the volume is the scheduled node's, data survives a pod restart -----


async def test_wffc_volume_lives_in_the_scheduled_nodes_pool_only(
    stack: StorageStack, namespace: str
) -> None:
    api = stack.api
    pvc = await claim(api, namespace, "64Mi", WFFC)
    await pod(api, namespace, "app", pvc)
    placed = await running(api, namespace, "app")
    node = placed["spec"]["nodeName"]
    pv = await bound_volume(api, namespace, pvc)
    pv_name = pv["metadata"]["name"]

    assert affinity_nodes(pv) == [[node]], "the PV's node affinity names the scheduled node only"
    assert backing_files(stack)[handle_of(pv)] == [node], "the backing file is in that node's pool only"
    assert await attachments_of(api, pv_name) == [], "attachRequired: false: no VolumeAttachment"
    claim_obj = await api.get(PERSISTENT_VOLUME_CLAIMS, pvc, namespace)
    assert claim_obj["metadata"]["annotations"]["volume.kubernetes.io/selected-node"] == node

    mount = stack.mount_path(node, placed, pv_name)
    written = write_data(mount)
    await delete_pod(api, namespace, "app")
    # The same claim again: the PV's affinity brings the new pod back to the volume's node.
    await pod(api, namespace, "app2", pvc)
    again = await running(api, namespace, "app2")
    assert again["spec"]["nodeName"] == node
    assert checksum(stack.mount_path(node, again, pv_name)) == written, "the data survived the restart"
    assert await attachments_of(api, pv_name) == []

    await delete_pod(api, namespace, "app2")
    await delete_claims_and_wait(stack, namespace, [pvc])
    assert not stack.mounts(), "nothing stays mounted on either node"


# -- (b) Immediate claims: one node each, exactly once ----------------------------------------------


async def test_twenty_immediate_claims_each_provisioned_once_on_one_node(
    stack: StorageStack, namespace: str
) -> None:
    api = stack.api
    before = set(backing_files(stack))
    names = await asyncio.gather(*(claim(api, namespace, "16Mi", IMMEDIATE, f"imm-{i}") for i in range(20)))
    pvs = [await bound_volume(api, namespace, n, timeout=120) for n in names]

    handles = [handle_of(pv) for pv in pvs]
    assert len(set(handles)) == 20, "one volume per claim"
    assert len(await volumes_of(api, namespace)) == 20, "one PV per claim, no duplicate"
    files = backing_files(stack)
    assert set(files) - before == set(handles), "one backing file per claim, nothing else"
    for pv in pvs:
        (node,) = files[handle_of(pv)]  # in exactly one pool
        assert affinity_nodes(pv) == [[node]], "the PV names the node whose pool holds it"
    await delete_claims_and_wait(stack, namespace, list(names))


# -- (c) capacity-aware scheduling by the real kube-scheduler ----------------------------------------


async def wait_capacity_below(api: ApiClient, node: str, limit: int) -> None:
    async def check() -> bool:
        caps = await capacities(api, WFFC)
        return caps is not None and caps[node] < limit

    await eventually_async(f"{node}'s published capacity below {limit >> 20}Mi", check, 60, 0.5)


async def test_scheduler_places_a_pod_where_its_claim_fits_or_nowhere(
    stack: StorageStack, namespace: str
) -> None:
    api = stack.api
    # node-a nearly full: 768Mi of its 1Gi.
    filler = await claim(api, namespace, "768Mi", WFFC)
    await pod(api, namespace, "filler", filler, node="node-a")
    assert (await running(api, namespace, "filler"))["spec"]["nodeName"] == "node-a"
    await wait_capacity_below(api, "node-a", 512 * MI)

    # 512Mi fits only on node-b.
    fits = await claim(api, namespace, "512Mi", WFFC)
    await pod(api, namespace, "fits", fits)
    assert (await running(api, namespace, "fits"))["spec"]["nodeName"] == "node-b"
    pv = await bound_volume(api, namespace, fits)
    assert backing_files(stack)[handle_of(pv)] == ["node-b"]
    await wait_capacity_below(api, "node-b", 768 * MI)

    # 768Mi fits nowhere now (node-a 256Mi left, node-b 512Mi): Pending, the scheduler says why.
    before = set(backing_files(stack))
    nowhere = await claim(api, namespace, "768Mi", WFFC)
    await pod(api, namespace, "nowhere", nowhere)

    async def unschedulable() -> str | None:
        p = await api.get(PODS, "nowhere", namespace)
        for cond in p.get("status", {}).get("conditions") or []:
            if cond["type"] == "PodScheduled" and cond["status"] == "False":
                return str(cond.get("message", ""))
        return None

    message: str = await eventually_async("the scheduler's verdict", unschedulable, 60, 0.5)
    assert NO_ROOM in message, message
    await scheduler_says(api, namespace, "nowhere", NO_ROOM)

    async def left_pending() -> list[str]:
        pvc = await api.get(PERSISTENT_VOLUME_CLAIMS, nowhere, namespace)
        problems = [f"phase {pvc['status']['phase']}"] if pvc["status"]["phase"] != "Pending" else []
        problems += [f"volumeName {pvc['spec']['volumeName']}"] if pvc["spec"].get("volumeName") else []
        if "volume.kubernetes.io/selected-node" in (pvc["metadata"].get("annotations") or {}):
            problems.append("a selected node")
        made = set(backing_files(stack)) - before
        return problems + ([f"volumes made for it: {made}"] if made else [])

    # Time for a wrong provisioning to show.
    await consistently_async(
        "the claim that fits nowhere left Pending", left_pending, 3, 0.2, satisfied=no_problems
    )

    for name in ("filler", "fits", "nowhere"):
        await delete_pod(api, namespace, name)
    await delete_claims_and_wait(stack, namespace, [filler, fits, nowhere])


# -- (d) kill -9 during a burst ----------------------------------------------------------------------


async def test_kill9_of_a_driver_and_a_provisioner_during_thirty_provisions_converges(
    stack: StorageStack, namespace: str
) -> None:
    api = stack.api
    before = set(backing_files(stack))
    names = [f"burst-{i}" for i in range(30)]
    creating = asyncio.gather(*(claim(api, namespace, "16Mi", IMMEDIATE, n) for n in names))

    async def some_provisioned() -> bool:
        return bool(set(backing_files(stack)) - before)

    await eventually_async("the first volumes made", some_provisioned, 60, 0.05)
    await stack.kill9("csi-driver-node-node-a")
    await stack.kill9("external-provisioner-node-b")
    await creating
    pvs = [await bound_volume(api, namespace, n, timeout=180) for n in names]

    handles = {handle_of(pv) for pv in pvs}
    assert len(handles) == 30, "one volume per claim"
    assert len(await volumes_of(api, namespace)) == 30, "one PV per claim, no duplicate"
    files = backing_files(stack)
    assert set(files) - before == handles, "no leaked backing file: every file new since is a PV's"
    assert all(len(files[h]) == 1 for h in handles), "each volume in exactly one pool"
    await delete_claims_and_wait(stack, namespace, names)
    assert set(backing_files(stack)) == before


# -- (e) bad input: a claim larger than any node's pool ----------------------------------------------


async def test_a_claim_larger_than_every_pool_gets_a_clear_event_and_leaks_nothing(
    stack: StorageStack, namespace: str
) -> None:
    api = stack.api
    before = set(backing_files(stack))
    pvs_before = len((await api.list_all(PERSISTENT_VOLUMES))[0])
    # WaitForFirstConsumer: the scheduler finds no node and says why, on the pod.
    big = await claim(api, namespace, "4Gi", WFFC)
    await pod(api, namespace, "big", big)
    await scheduler_says(api, namespace, "big", NO_ROOM)
    # Immediate: no node's provisioner takes a claim its pool cannot hold (upstream's election
    # checks GetCapacity first); the claim waits, as the pv-controller's event says.
    huge = await claim(api, namespace, "4Gi", IMMEDIATE)
    (waiting, *_) = await eventually_async(
        "ExternalProvisioning", lambda: events_for(api, namespace, huge, "ExternalProvisioning"), 30
    )
    assert DRIVER_NAME in waiting["message"]

    async def nothing_made() -> list[str]:
        problems = []
        for name in (big, huge):
            phase = (await api.get(PERSISTENT_VOLUME_CLAIMS, name, namespace))["status"]["phase"]
            problems += [f"{name} {phase}"] if phase != "Pending" else []
        pvs = len((await api.list_all(PERSISTENT_VOLUMES))[0])
        problems += [f"{pvs} PVs, {pvs_before} before"] if pvs != pvs_before else []
        made = set(backing_files(stack)) - before
        return problems + ([f"backing files made: {made}"] if made else [])

    # Two election rounds at the stack's 2 s base delay.
    await consistently_async(
        "the 4Gi claims Pending, no PV, no file", nothing_made, 5, 0.2, satisfied=no_problems
    )
    await delete_pod(api, namespace, "big")


# -- (f) expansion ------------------------------------------------------------------------------------


async def test_expansion_of_a_mounted_node_local_volume(stack: StorageStack, namespace: str) -> None:
    api = stack.api
    pvc = await claim(api, namespace, "320Mi", XFS)
    await pod(api, namespace, "grow", pvc)
    placed = await running(api, namespace, "grow")
    node = placed["spec"]["nodeName"]
    pv = await bound_volume(api, namespace, pvc)
    mount = stack.mount_path(node, placed, pv["metadata"]["name"])
    written = write_data(mount)
    before = os.statvfs(mount)
    backing = stack.node_pool(node) / "volumes" / f"{handle_of(pv)}.img"

    grow_to = {"spec": {"resources": {"requests": {"storage": "512Mi"}}}}
    await api.patch(PERSISTENT_VOLUME_CLAIMS, pvc, grow_to, namespace=namespace)

    async def grown() -> bool:
        got = await api.get(PERSISTENT_VOLUME_CLAIMS, pvc, namespace)
        return bool(got.get("status", {}).get("capacity", {}).get("storage") == "512Mi")

    await eventually_async("the claim at 512Mi", grown, 90, 0.3)
    assert backing.stat().st_size == 512 * MI, "the node's own resizer grew the file in its pool"
    volume = await api.get(PERSISTENT_VOLUMES, pv["metadata"]["name"])
    assert volume["spec"]["capacity"]["storage"] == "512Mi"
    after = os.statvfs(mount)
    assert after.f_blocks * after.f_frsize > before.f_blocks * before.f_frsize + 150 * MI, "xfs grew online"
    assert checksum(mount) == written
    await delete_pod(api, namespace, "grow")
    await delete_claims_and_wait(stack, namespace, [pvc])


# -- (g) a node that is gone -------------------------------------------------------------------------


NODE_B_PROCESSES = tuple(f"{c}-node-b" for c in ("node-agent", "external-resizer", "external-provisioner"))


async def test_a_deleted_node_takes_its_claims_and_volumes_with_it(
    stack: StorageStack, namespace: str
) -> None:
    """node-b's machine goes away (its processes stop, its plugin last) and the admin deletes its
    Node: the node finalizer deletes the claim and the PV pinned to it, with events saying so, and
    lets the Node go. When the machine comes back its agent registers the Node again; the backing
    file is still in its pool, as the PV's event says, for the admin to remove."""
    api = stack.api
    pvc = await claim(api, namespace, "32Mi", WFFC)
    await pod(api, namespace, "doomed", pvc, node="node-b")
    await running(api, namespace, "doomed")
    pv = await bound_volume(api, namespace, pvc)
    pv_name = pv["metadata"]["name"]
    await delete_pod(api, namespace, "doomed")
    node = await api.get(NODES, "node-b")
    assert FINALIZER in node["metadata"].get("finalizers", [])

    for name in (*NODE_B_PROCESSES, "csi-driver-node-node-b"):
        proc = stack.process(name)
        proc.disarm()
        await proc.stop(15)
    await api.delete(NODES, "node-b")
    await eventually_async("the Node let go", functools.partial(gone, api, NODES, "node-b"), 60, 0.3)
    assert await gone(api, PERSISTENT_VOLUME_CLAIMS, pvc, namespace), "the claim pinned to it deleted"
    await eventually_async("the PV deleted", functools.partial(gone, api, PERSISTENT_VOLUMES, pv_name), 30)
    (claim_event,) = await eventually_async(
        "ClaimDeletedNodeGone", lambda: events_for(api, namespace, pvc, "ClaimDeletedNodeGone"), 30
    )
    assert "node-b" in claim_event["message"] and pv_name in claim_event["message"]
    assert backing_files(stack)[handle_of(pv)] == ["node-b"], "the machine's pool is not reachable to clean"

    # The machine comes back: its plugin, then the rest; its agent registers the Node again.
    for name in ("csi-driver-node-node-b", *reversed(NODE_B_PROCESSES)):
        await stack.process(name).start()
    await eventually_async(
        "node-b registered with its plugin again", functools.partial(labelled, api, "node-b"), 60
    )
    (stack.node_pool("node-b") / "volumes" / f"{handle_of(pv)}.img").unlink()  # the admin's part
