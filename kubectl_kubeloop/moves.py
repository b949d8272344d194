"""`kubectl kubeloop move pvc NAME --to NODE` and `kubectl kubeloop drain NODE`: node-local volumes
moved to another node (docs/volume-moves.md).

This command only asks and follows: it checks the move can be made, writes the intent on the PV
(controller_runtime.volume_moves) and shows the node plugins' progress. The plugins carry it out,
so killing this command changes nothing: run it again to follow the move, or `--cancel` it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from controller_runtime.client import PATCH_TYPES, ApiClient, ApiError
from controller_runtime.driver_names import TOPOLOGY_PREFIX
from controller_runtime.kinds import Node, PersistentVolume, Pod, node_view, pod_view, pv_view, pvc_view
from controller_runtime.quantity import format_quantity, parse_quantity
from controller_runtime.resources import (
    CSI_STORAGE_CAPACITIES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    Obj,
)
from controller_runtime.volume_moves import (
    FROM_LABEL,
    STATE_ANNOTATION,
    TO_LABEL,
    affinity_node,
    cancel_patch,
    intent_patch,
    moving,
    node_affinity,
)

POLL_SECONDS = 1.0


class Refused(Exception):
    """A move this command will not ask for; the message says why and what to do."""


def topology_key_of(pv: PersistentVolume) -> str:
    """The kubeloop topology key a node-local PV's affinity uses, or ""."""
    for term in pv.get("spec", {}).get("nodeAffinity", {}).get("required", {}).get("nodeSelectorTerms", []):
        for expr in term.get("matchExpressions", []):
            key = expr.get("key", "")
            if key.startswith(TOPOLOGY_PREFIX + "/"):
                return key
    return ""


def _ready(node: Node) -> bool:
    conditions = node.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def target_problem(node: Node | None, name: str, key: str) -> str | None:
    """Why `node` cannot take a volume of `key`'s driver, or None."""
    if node is None:
        return f"node {name} does not exist"
    if key not in (node.get("metadata", {}).get("labels") or {}):
        return f"node {name} runs no node plugin of this volume's driver (it has no {key} label)"
    if node.get("spec", {}).get("unschedulable"):
        return f"node {name} is cordoned"
    if not _ready(node):
        return f"node {name} is not Ready"
    return None


def claim_users(pods: Iterable[Pod], claim: str) -> list[Pod]:
    """The pods of the claim's namespace that use it and have not ended."""
    return [
        p
        for p in pods
        if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")
        and any(
            v.get("persistentVolumeClaim", {}).get("claimName") == claim
            for v in p.get("spec", {}).get("volumes", [])
        )
    ]


@dataclass
class Plan:
    pv: str
    claim: str  # namespace/name, "" when unbound
    source: str
    target: str = ""
    refused: str = ""


@dataclass
class Rooms:
    """Room per (node, class) from the CSIStorageCapacity objects, less what this run plans."""

    free: dict[tuple[str, str], int] = field(default_factory=dict)

    @classmethod
    def of(cls, capacities: Iterable[Obj], key: str) -> Rooms:
        rooms = cls()
        for cap in capacities:
            node = (cap.get("nodeTopology") or {}).get("matchLabels", {}).get(key)
            if node and "capacity" in cap:
                rooms.free[(node, cap.get("storageClassName", ""))] = parse_quantity(cap["capacity"])
        return rooms

    def pick(self, candidates: Sequence[str], storage_class: str, size: int) -> str | None:
        """The candidate with the most room for `size` bytes of `storage_class`, its room taken."""
        fits = [(self.free.get((n, storage_class), 0), n) for n in candidates]
        fits = [(room, n) for room, n in fits if room >= size]
        if not fits:
            return None
        room, node = max(fits, key=lambda f: (f[0], f[1]))
        self.free[(node, storage_class)] = room - size
        return node


def _size(pv: PersistentVolume) -> int:
    return parse_quantity(pv.get("spec", {}).get("capacity", {}).get("storage", "0"))


def _claim(pv: PersistentVolume) -> str:
    ref = pv.get("spec", {}).get("claimRef")
    return (
        f"{ref.get('namespace', '')}/{ref.get('name', '')}"
        if ref and pv.get("status", {}).get("phase") == "Bound"
        else ""
    )


async def _users(api: ApiClient, claim: str) -> list[Pod]:
    if not claim:
        return []
    namespace, name = claim.split("/", 1)
    pods, _ = await api.list_all(PODS, namespace)
    return claim_users([pod_view(p) for p in pods], name)


def _in_use(users: list[Pod]) -> str:
    names = ", ".join(f"{p['metadata'].get('namespace')}/{p['metadata']['name']}" for p in users)
    return f"it is used by pod(s) {names}: delete them or scale them down first"


async def _check_mutable(api: ApiClient, pv: PersistentVolume, key: str, target: str) -> None:
    """Refuses when the API server keeps node affinity immutable (MutablePVNodeAffinity off): asks
    it with a dry run of the very patch the target's plugin will make."""
    name = pv["metadata"]["name"]
    try:
        await api.request(
            "PATCH",
            PERSISTENT_VOLUMES.path(None, name),
            params={"dryRun": "All"},
            body={"spec": {"nodeAffinity": node_affinity(key, target)}},
            content_type=PATCH_TYPES["merge"],
        )
    except ApiError as e:
        if e.status == 422:
            raise Refused(
                "this cluster's API server keeps a PersistentVolume's node affinity immutable: moving "
                "a volume needs the MutablePVNodeAffinity feature gate on kube-apiserver (KEP-5381, "
                f"alpha in Kubernetes 1.35 and 1.36) ({e.message})"
            ) from e
        raise


async def _start(api: ApiClient, pv: PersistentVolume, target: str) -> None:
    key = topology_key_of(pv)
    source = affinity_node(pv, key)
    await _check_mutable(api, pv, key, target)
    md = pv["metadata"]
    patch = intent_patch(source, target, md.get("resourceVersion", ""))
    await api.patch(PERSISTENT_VOLUMES, md["name"], patch)


async def follow(api: ApiClient, targets: dict[str, str], timeout: float) -> dict[str, str]:
    """Waits until each PV (name -> target node) serves from its target with its move over, printing
    every new state the plugins write. Returns the PVs whose move did not end so, with why."""
    deadline = time.monotonic() + timeout
    last: dict[str, str] = {}
    ended: dict[str, str] = {}
    pending = dict(targets)
    while pending:
        for name, target in list(pending.items()):
            try:
                pv = pv_view(await api.get(PERSISTENT_VOLUMES, name))
            except ApiError as e:
                if not e.not_found:
                    raise
                pv = PersistentVolume()
            labels = pv.get("metadata", {}).get("labels") or {}
            state = (pv.get("metadata", {}).get("annotations") or {}).get(STATE_ANNOTATION, "")
            if state and state != last.get(name):
                print(f"{name}: {state}")
                last[name] = state
            if not pv:
                ended[name] = "the PersistentVolume was deleted"
            elif {TO_LABEL, FROM_LABEL} & labels.keys():
                continue
            elif affinity_node(pv, topology_key_of(pv)) == target:
                print(f"{name}: moved to node {target}")
            else:
                ended[name] = "the move was cancelled"
            pending.pop(name)
        if pending and time.monotonic() >= deadline:
            return ended | {n: last.get(n, "no progress reported") for n in pending}
        if pending:
            await asyncio.sleep(POLL_SECONDS)
    return ended


async def move(
    api: ApiClient, namespace: str, claim_name: str, target: str, timeout: float, cancel: bool
) -> int:
    claim = pvc_view(await api.get(PERSISTENT_VOLUME_CLAIMS, claim_name, namespace))
    volume = claim.get("spec", {}).get("volumeName", "")
    if not volume or claim.get("status", {}).get("phase") != "Bound":
        raise Refused(f"claim {namespace}/{claim_name} is not bound to a volume")
    pv = pv_view(await api.get(PERSISTENT_VOLUMES, volume))
    key = topology_key_of(pv)
    source = affinity_node(pv, key)
    if not key or not source:
        raise Refused(
            f"volume {volume} is not a node-local kubeloop volume (its node affinity names no one node)"
        )
    ongoing = moving(pv.get("metadata", {}).get("annotations") or {})
    if cancel:
        if ongoing is None:
            raise Refused(f"volume {volume} is not being moved")
        # On the PV as read: a switch that lands meanwhile makes this a conflict, not a false
        # "cancelled".
        try:
            await api.patch(
                PERSISTENT_VOLUMES, volume, cancel_patch(pv["metadata"].get("resourceVersion", ""))
            )
        except ApiError as e:
            if e.conflict:
                raise Refused(
                    f"volume {volume} changed while cancelling (its move may have switched): run again"
                ) from e
            raise
        print(
            f"{volume}: move to node {ongoing[1]} cancelled"
            if source == ongoing[0]
            else f"{volume}: the move had switched already; its end is cleaned up"
        )
        return 0
    if ongoing is not None:
        if ongoing[1] != target:
            raise Refused(f"volume {volume} is already being moved to node {ongoing[1]}; --cancel that first")
        print(f"{volume}: already being moved to node {target}; following it")
    elif source == target:
        print(f"{volume}: already on node {target}")
        return 0
    else:
        try:
            node: Node | None = node_view(await api.get(NODES, target))
        except ApiError as e:
            if not e.not_found:
                raise
            node = None
        if problem := target_problem(node, target, key):
            raise Refused(problem)
        if users := await _users(api, f"{namespace}/{claim_name}"):
            raise Refused(f"claim {namespace}/{claim_name}: {_in_use(users)}")
        await _start(api, pv, target)
        print(f"{volume}: moving from node {source} to node {target}")
    left = await follow(api, {volume: target}, timeout)
    for name, state in left.items():
        print(
            f"{name}: not moved yet ({state}); the move goes on without this command: "
            "run it again to follow it, or --cancel it"
        )
    return 1 if left else 0


async def plan_drain(api: ApiClient, node_name: str) -> list[Plan]:
    pvs = [pv_view(p) for p in (await api.list_all(PERSISTENT_VOLUMES))[0]]
    nodes = [node_view(n) for n in (await api.list_all(NODES))[0]]
    capacities, _ = await api.list_all(CSI_STORAGE_CAPACITIES)
    # One account of room per topology key for the whole drain: each volume sent somewhere takes
    # its size off that node's room for the next.
    rooms_by_key: dict[str, Rooms] = {}
    plans: list[Plan] = []
    for pv in sorted(pvs, key=lambda p: p["metadata"]["name"]):
        key = topology_key_of(pv)
        if not key or affinity_node(pv, key) != node_name:
            continue
        plan = Plan(pv["metadata"]["name"], _claim(pv), node_name)
        plans.append(plan)
        phase = pv.get("status", {}).get("phase")
        if phase in ("Released", "Failed"):
            plan.refused = f"it is {phase} (its claim is gone): delete it, or bind it again, instead"
            continue
        if (ongoing := moving(pv.get("metadata", {}).get("annotations") or {})) is not None:
            plan.target = ongoing[1]
            continue
        users = [
            p for p in await _users(api, plan.claim) if not p.get("metadata", {}).get("deletionTimestamp")
        ]
        if users:
            plan.refused = _in_use(users)
            continue
        candidates = [
            str(n["metadata"]["name"])
            for n in nodes
            if target_problem(n, str(n["metadata"]["name"]), key) is None
            and n["metadata"]["name"] != node_name
        ]
        if not candidates:
            plan.refused = "no other Ready, schedulable node runs this driver's node plugin"
            continue
        rooms = rooms_by_key.setdefault(key, Rooms.of(capacities, key))
        target = rooms.pick(candidates, pv.get("spec", {}).get("storageClassName", ""), _size(pv))
        if target is None:
            plan.refused = (
                f"no node has room for {format_quantity(_size(pv))} (CSIStorageCapacity of its class)"
            )
            continue
        plan.target = target
    return plans


async def drain(api: ApiClient, node_name: str, timeout: float) -> int:
    try:
        node = node_view(await api.get(NODES, node_name))
    except ApiError as e:
        if e.not_found:
            raise Refused(f"node {node_name} does not exist") from e
        raise
    if not node.get("spec", {}).get("unschedulable"):
        raise Refused(
            f"node {node_name} is not cordoned: run `kubectl cordon {node_name}` first, "
            "so no new pod lands there"
        )
    # A volume whose pods are being evicted is asked to move at once: its node's plugin releases
    # it once they are gone and its copy is unstaged.
    deadline = time.monotonic() + timeout
    plans = await plan_drain(api, node_name)
    started: dict[str, str] = {}
    for plan in plans:
        if plan.refused or not plan.target:
            continue
        pv = pv_view(await api.get(PERSISTENT_VOLUMES, plan.pv))
        if moving(pv.get("metadata", {}).get("annotations") or {}) is None:
            try:
                await _start(api, pv, plan.target)
            except Refused as e:
                plan.refused = str(e)
                continue
        print(f"{plan.pv}: moving from node {node_name} to node {plan.target}")
        started[plan.pv] = plan.target
    left = await follow(api, started, max(0.0, deadline - time.monotonic())) if started else {}
    moved = [p for p in plans if p.pv in started and p.pv not in left]
    print(f"drain {node_name}: {len(moved)} of {len(plans)} volume(s) moved")
    for plan in plans:
        if plan.refused:
            print(f"  cannot move {plan.pv}{f' (claim {plan.claim})' if plan.claim else ''}: {plan.refused}")
        elif plan.pv in left:
            print(f"  {plan.pv}: not moved yet ({left[plan.pv]}); run the drain again to follow it")
    return 0 if len(moved) == len(plans) else 1
