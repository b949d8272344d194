"""A claim's story from a Snapshot, decided without reading anything: the objects in its chain, the
steps of its volume's life with their times, and, when something is stuck, which component is
waiting for what, in words.

Times come from what the API keeps: creation timestamps, the time of each manager's last write in
`managedFields` (the attacher's status write is when a VolumeAttachment became attached), pod
conditions' transition times, and the components' events.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from controller_runtime import counterpart
from controller_runtime.attach_rules import (
    attach_required,
    multi_attach_allowed,
    node_ready,
    node_ready_condition,
)
from controller_runtime.kinds import Condition, KubeObject, Node, PersistentVolume, PersistentVolumeClaim, Pod
from controller_runtime.quantity import parse_quantity
from controller_runtime.resources import (
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    VOLUME_ATTACHMENTS,
    Obj,
    Resource,
)
from controller_runtime.storage import (
    ANN_BETA_STORAGE_PROVISIONER,
    ANN_SELECTED_NODE,
    ANN_STORAGE_PROVISIONER,
)
from controller_runtime.volumes import pod_terminated

from .snapshot import Snapshot, event_time


@dataclass
class Step:
    name: str  # provision, bind, attach, mount, expand, modify
    subject: str  # what it is about: the volume, `va/<name>`, `pod/<name>`
    started: str | None
    ended: str | None  # None: not done

    def seconds(self, now: dt.datetime) -> float | None:
        if self.started is None:
            return None
        end = parse_time(self.ended) if self.ended else now
        return round((end - parse_time(self.started)).total_seconds(), 1)


@dataclass
class Waiting:
    component: str
    reason: str


@dataclass
class Link:
    kind: str
    name: str
    state: str  # phase, attached or not, Ready or not
    details: list[str] = field(default_factory=list)  # conditions and the like


@dataclass
class Report:
    claim: str  # namespace/name
    phase: str
    chain: list[Link]
    steps: list[Step]
    waiting: list[Waiting]
    events: list[Obj]
    # What the components' queues are retrying about the chain (kubectl_kubeloop.retries), filled
    # by the caller: reading it is not this module's business.
    retries: list[Any] = field(default_factory=list)
    # kube-controller-manager and kubeloop's controllers on the same job: a kubeloop controller
    # that stood down for its kcm counterpart, or both seen writing the chain's objects.
    control_plane: list[Waiting] = field(default_factory=list)

    def to_json(self, now: dt.datetime) -> dict[str, Any]:
        return {
            "claim": self.claim,
            "phase": self.phase,
            "stuck": bool(self.waiting),
            "chain": [vars(link) for link in self.chain],
            "steps": [{**vars(s), "seconds": s.seconds(now)} for s in self.steps],
            "waiting": [vars(w) for w in self.waiting],
            "retries": [vars(r) for r in self.retries],
            "control_plane": [vars(c) for c in self.control_plane],
            "events": [
                {
                    "time": event_time(e),
                    "type": e.get("type", ""),
                    "reason": e.get("reason", ""),
                    "object": f"{e['involvedObject'].get('kind', '')}/{e['involvedObject'].get('name', '')}",
                    "source": (e.get("source") or {}).get("component") or e.get("reportingComponent", ""),
                    "count": e.get("count") or 1,
                    "message": e.get("message", ""),
                }
                for e in self.events
            ],
        }


def parse_time(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _written(obj: KubeObject, manager_hint: str = "", status: bool = False) -> str | None:
    """When the object's status (or spec) was last written, by a manager whose name contains
    `manager_hint`, from managedFields."""
    times = [
        str(m.get("time"))
        for m in obj["metadata"].get("managedFields") or []
        if m.get("time")
        and manager_hint in str(m.get("manager", ""))
        and (m.get("subresource") == "status") == status
    ]
    return max(times) if times else None


def _events(snap: Snapshot, reasons: tuple[str, ...], obj: KubeObject | None = None) -> list[Obj]:
    uid = obj["metadata"]["uid"] if obj is not None else None
    return [
        e
        for e in snap.events
        if e.get("reason") in reasons and (uid is None or e["involvedObject"].get("uid") == uid)
    ]


def _condition(obj: Pod | PersistentVolumeClaim, kind: str) -> Condition | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return c.copy()
    return None


def _node_ready(node: Node | None) -> tuple[bool, str]:
    """attach_rules.node_ready, and why not in words."""
    if node_ready(node):
        return True, ""
    if node is None:
        return False, "the Node object does not exist"
    ready = node_ready_condition(node)
    if ready is None:
        return False, "it never reported Ready"
    return False, (
        f"Ready is {ready.get('status')} since {ready.get('lastTransitionTime')}"
        f" ({ready.get('reason', '')}: {ready.get('message', '')})"
    )


def _provisioner(claim: PersistentVolumeClaim) -> str:
    ann = claim["metadata"].get("annotations") or {}
    return str(ann.get(ANN_STORAGE_PROVISIONER) or ann.get(ANN_BETA_STORAGE_PROVISIONER) or "")


def _latest(events: list[Obj]) -> Obj | None:
    return events[-1] if events else None


def chain_keys(snap: Snapshot) -> set[str]:
    """The work queue keys the chain's objects may have: claims and pods as namespace/name, PVs and
    VolumeAttachments by name, and each by UID (the provisioner's claims queue)."""
    objects = [snap.claim, *snap.pods, *snap.attachments, *([snap.volume] if snap.volume else [])]
    keys = {str(o["metadata"].get("uid", "")) for o in objects}
    keys |= {f"{snap.namespace}/{o['metadata']['name']}" for o in [snap.claim, *snap.pods]}
    keys |= {str(o["metadata"]["name"]) for o in [*snap.attachments, *([snap.volume] if snap.volume else [])]}
    return keys - {""}


def diagnose(snap: Snapshot) -> Report:
    claim, pv = snap.claim, snap.volume
    md, status = claim["metadata"], claim.get("status") or {}
    phase = str(status.get("phase") or "Pending")
    chain = [Link("PersistentVolumeClaim", f"{md['namespace']}/{md['name']}", phase, _claim_details(claim))]
    steps: list[Step] = []
    waiting: list[Waiting] = []
    if pv is not None:
        pv_phase = str((pv.get("status") or {}).get("phase") or "")
        chain.append(Link("PersistentVolume", pv["metadata"]["name"], pv_phase, _pv_details(pv)))
    for va in snap.attachments:
        va_status = va.get("status") or {}
        state = "attached" if va_status.get("attached") else "not attached"
        details = [f"node {va['spec'].get('nodeName')}"]
        for key in ("attachError", "detachError"):
            if va_status.get(key):
                details.append(f"{key}: {va_status[key].get('message', '')}")
        if va["metadata"].get("deletionTimestamp"):
            state += ", deleting"
        chain.append(Link("VolumeAttachment", va["metadata"]["name"], state, details))
    for name, node in snap.nodes.items():
        ready, why = _node_ready(node)
        chain.append(Link("Node", name, "Ready" if ready else "NotReady", [why] if why else []))
    for pod in snap.pods:
        chain.append(Link("Pod", pod["metadata"]["name"], _pod_state(pod), _pod_details(pod)))

    _claim_steps(snap, steps, waiting)
    if phase == "Bound" and pv is not None:
        for pod in snap.pods:
            if not pod_terminated(pod):
                _pod_steps(snap, pod, pv, steps, waiting)
        _expansion(snap, steps, waiting)
        _modification(snap, steps, waiting)
    report = Report(f"{md['namespace']}/{md['name']}", phase, chain, steps, waiting, snap.events)
    report.control_plane = _control_plane(snap)
    return report


# -- kube-controller-manager beside kubeloop's controllers -------------------------------------------


def _control_plane(snap: Snapshot) -> list[Waiting]:
    """Each kubeloop controller that stood down (its newest KubeControllerManagerActive Warning),
    then each of kcm's storage controllers that wrote the chain's objects beside the kubeloop
    controller replacing it (their fields in managedFields: controller_runtime.counterpart)."""
    out: list[Waiting] = []
    newest: dict[str, Obj] = {}
    for e in snap.stand_downs:
        newest[str((e.get("source") or {}).get("component") or e.get("reportingComponent") or "")] = e
    for who, e in sorted(newest.items()):
        out.append(Waiting(who or "kubeloop", f"stands down since {event_time(e)}: {e.get('message', '')}"))
    chain: list[tuple[counterpart.Counterpart, Resource, KubeObject | None]] = [
        (counterpart.BINDER, PERSISTENT_VOLUME_CLAIMS, snap.claim),
        (counterpart.BINDER, PERSISTENT_VOLUMES, snap.volume),
        *((counterpart.ATTACH_DETACH, VOLUME_ATTACHMENTS, va) for va in snap.attachments),
        *((counterpart.ATTACH_DETACH, NODES, node) for node in snap.nodes.values()),
    ]
    for cp in (counterpart.BINDER, counterpart.ATTACH_DETACH):
        wrote: dict[str, list[str]] = {}
        for of, resource, obj in chain:
            if of is not cp or obj is None:
                continue
            name = obj["metadata"]["name"]
            subject = (
                f"{resource.kind} {obj['metadata']['namespace']}/{name}"
                if resource.namespaced
                else f"{resource.kind} {name}"
            )
            for manager, fields in counterpart.writers(cp, resource, obj).items():
                wrote.setdefault(manager, []).append(f"{subject} {', '.join(fields)}")
        ours = sorted(m for m in wrote if m.startswith("kubeloop-"))
        if counterpart.KCM_MANAGER in wrote and ours:
            told = "; ".join(f"{m}: {', '.join(wrote[m])}" for m in (counterpart.KCM_MANAGER, *ours))
            out.append(
                Waiting(
                    f"kube-controller-manager's {cp.controller} and {', '.join(ours)}",
                    f"both wrote this claim's objects ({told}): run one of the two, kcm's turns off "
                    f"with {cp.flag}",
                )
            )
    return out


# -- the claim: class, provisioning, binding -----------------------------------------------------------


def _claim_details(claim: PersistentVolumeClaim) -> list[str]:
    spec, status = claim.get("spec") or {}, claim.get("status") or {}
    out = [
        f"class {spec.get('storageClassName')!r}",
        f"requests {((spec.get('resources') or {}).get('requests') or {}).get('storage', '?')}",
        f"access {','.join(spec.get('accessModes') or [])}",
    ]
    if (status.get("capacity") or {}).get("storage"):
        out.append(f"capacity {status['capacity']['storage']}")
    for c in status.get("conditions") or []:
        out.append(f"condition {c.get('type')}={c.get('status')} {c.get('message', '')}".rstrip())
    if spec.get("volumeAttributesClassName") or status.get("currentVolumeAttributesClassName"):
        out.append(
            f"attributes class {spec.get('volumeAttributesClassName')!r}"
            f" (current {status.get('currentVolumeAttributesClassName')!r})"
        )
    return out


def _pv_details(pv: PersistentVolume) -> list[str]:
    spec = pv.get("spec") or {}
    csi = spec.get("csi") or {}
    out = [f"capacity {(spec.get('capacity') or {}).get('storage', '?')}"]
    if csi:
        out.append(f"driver {csi.get('driver')} handle {csi.get('volumeHandle')}")
    out.append(f"reclaim {spec.get('persistentVolumeReclaimPolicy')}")
    message = (pv.get("status") or {}).get("message")
    if message:
        out.append(str(message))
    return out


def _claim_steps(snap: Snapshot, steps: list[Step], waiting: list[Waiting]) -> None:
    claim, pv, sc = snap.claim, snap.volume, snap.storage_class
    created = str(claim["metadata"].get("creationTimestamp") or "")
    phase = (claim.get("status") or {}).get("phase") or "Pending"
    provisioner = _provisioner(claim)
    if pv is not None and (pv["metadata"].get("annotations") or {}).get("pv.kubernetes.io/provisioned-by"):
        started = _latest(_events(snap, ("Provisioning",), claim)[:1])
        steps.append(
            Step("provision", f"pv/{pv['metadata']['name']}", event_time(started) if started else created,
                 str(pv["metadata"].get("creationTimestamp")))
        )  # fmt: skip
    if phase == "Bound":
        steps.append(Step("bind", "claim", created, _written(claim, status=True) or created))
        return
    if phase == "Lost":
        waiting.append(
            Waiting(
                "pv-controller", f"the claim lost its volume {claim['spec'].get('volumeName')}: it is gone"
            )
        )
        return
    # Pending.
    class_name = (claim.get("spec") or {}).get("storageClassName")
    bind_step = Step("provision" if provisioner else "bind", "claim", created, None)
    steps.append(bind_step)
    if class_name and sc is None:
        waiting.append(Waiting("pv-controller", f"StorageClass {class_name!r} does not exist"))
        return
    if sc is not None and sc.get("volumeBindingMode") == "WaitForFirstConsumer":
        selected = (claim["metadata"].get("annotations") or {}).get(ANN_SELECTED_NODE)
        if not selected:
            users = [p for p in snap.pods if not pod_terminated(p)]
            if not users:
                waiting.append(
                    Waiting(
                        "kube-scheduler",
                        f"class {class_name!r} binds at the first consumer and no pod uses the claim yet",
                    )
                )
                return
            for pod in users:
                sched = _condition(pod, "PodScheduled")
                if sched is not None and sched.get("status") == "False":
                    unplaced = f"pod {pod['metadata']['name']} cannot be placed: {sched.get('message')}"
                    waiting.append(Waiting("kube-scheduler", unplaced))
            if waiting:
                return
    if provisioner:
        failed = _events(snap, ("ProvisioningFailed",), claim)
        failed = [
            e for e in failed if (e.get("source") or {}).get("component") != "persistentvolume-controller"
        ]
        who = f"external-provisioner ({provisioner})"
        if failed:
            waiting.append(Waiting(who, f"provisioning fails: {failed[-1].get('message')}"))
        elif _events(snap, ("Provisioning",), claim):
            waiting.append(
                Waiting(who, f"provisioning since {event_time(_events(snap, ('Provisioning',), claim)[0])}")
            )
        else:
            waiting.append(
                Waiting(
                    who, "no provisioner has taken the claim yet (no Provisioning event): is one running?"
                )
            )
        return
    failed_binding = _latest(_events(snap, ("FailedBinding",), claim))
    reason = "no PersistentVolume matches the claim (size, access modes, class, selector)"
    if not class_name:
        reason += ", and the claim names no class to provision from"
    if failed_binding is not None:
        reason += f": {failed_binding.get('message')}"
    waiting.append(Waiting("pv-controller", reason))


# -- a pod of the claim: attach and mount ----------------------------------------------------------------


def _pod_state(pod: Pod) -> str:
    status = pod.get("status") or {}
    ready = _condition(pod, "Ready")
    state = str(status.get("phase") or "Pending")
    if ready is not None:
        state += ", Ready" if ready.get("status") == "True" else ", not Ready"
    if pod["metadata"].get("deletionTimestamp"):
        state += ", terminating"
    return state


def _pod_details(pod: Pod) -> list[str]:
    node = (pod.get("spec") or {}).get("nodeName")
    return [f"node {node}" if node else "not scheduled"]


def _running_since(pod: Pod) -> str | None:
    for kind in ("ContainersReady", "Ready", "PodReadyToStartContainers"):
        c = _condition(pod, kind)
        if c is not None and c.get("status") == "True":
            return str(c.get("lastTransitionTime"))
    return None


def _pod_steps(
    snap: Snapshot, pod: Pod, pv: PersistentVolume, steps: list[Step], waiting: list[Waiting]
) -> None:
    pod_name = pod["metadata"]["name"]
    node = (pod.get("spec") or {}).get("nodeName")
    if not node:
        sched = _condition(pod, "PodScheduled")
        message = (sched or {}).get("message") or "not placed yet"
        waiting.append(Waiting("kube-scheduler", f"pod {pod_name} is not scheduled: {message}"))
        return
    running = _running_since(pod)
    mount_start = str(pod["metadata"].get("creationTimestamp"))
    ready, why = _node_ready(snap.nodes.get(node))
    if running is None and not ready:
        # Nothing happens for this pod until its node reports: not its attach (the attach-detach
        # controller attaches only to nodes that exist and report), not its mount.
        waiting.append(Waiting(f"kubelet on {node}", f"node {node} does not report: {why}"))
        return
    if attach_required(snap.csi_driver):
        va = next((v for v in snap.attachments if v["spec"].get("nodeName") == node), None)
        if va is None:
            if running is None:
                waiting.append(Waiting("attach-detach controller", _no_attachment(snap, pod, pv, node)))
            return
        va_md, va_status = va["metadata"], va.get("status") or {}
        attached_at = _written(va, "attacher", status=True) if va_status.get("attached") else None
        steps.append(Step("attach", f"va/{va_md['name']}", va_md.get("creationTimestamp"), attached_at))
        if attached_at is None:
            error = (va_status.get("attachError") or {}).get("message")
            who = f"external-attacher ({(va.get('spec') or {}).get('attacher', '')})"
            if error:
                waiting.append(Waiting(who, f"attaching to {node} fails: {error}"))
            else:
                created = va_md.get("creationTimestamp")
                waiting.append(Waiting(who, f"{va_md['name']} is not attached yet (created {created})"))
            return
        mount_start = max(mount_start, attached_at)
    steps.append(Step("mount", f"pod/{pod_name}", mount_start, running))
    if running is not None:
        return
    failed = _latest(_events(snap, ("FailedMount", "FailedMapVolume"), pod))
    if failed is not None:
        waiting.append(Waiting(f"kubelet on {node}", f"mounting fails: {failed.get('message')}"))
    else:
        waiting.append(Waiting(f"kubelet on {node}", f"staging and publishing the volume for pod {pod_name}"))


def _no_attachment(snap: Snapshot, pod: Pod, pv: PersistentVolume, node: str) -> str:
    pv_name = pv["metadata"]["name"]
    # The attach-detach controller refuses an exclusive volume (attach_rules.multi_attach_allowed)
    # with a Multi-Attach error while it is attached to another node by a VolumeAttachment not
    # being deleted; it waits silently while one there is being deleted.
    exclusive = not multi_attach_allowed((pv.get("spec") or {}).get("accessModes") or ())
    elsewhere = [va for va in snap.attachments if va["spec"].get("nodeName") != node]
    holders = [
        va
        for va in elsewhere
        if (va.get("status") or {}).get("attached") and not va["metadata"].get("deletionTimestamp")
    ]
    leaving = [va for va in elsewhere if va["metadata"].get("deletionTimestamp")]
    if exclusive and holders:
        other = holders[0]["spec"].get("nodeName")
        users = [
            p["metadata"]["name"]
            for p in snap.pods
            if (p.get("spec") or {}).get("nodeName") == other and not pod_terminated(p)
        ]
        in_use = f"still in use there by pod {', '.join(users)}" if users else "still reported in use there"
        return (
            f"volume {pv_name} is attached to {other} and {in_use}; it can be attached to {node} only "
            f"once {other} stops reporting it (Multi-Attach: its access modes allow one node)"
        )
    if exclusive and leaving:
        other = leaving[0]["spec"].get("nodeName")
        return (
            f"volume {pv_name} is being detached from {other}; its access modes allow one node, so it is "
            f"attached to {node} once that detach ends"
        )
    failed = _latest(_events(snap, ("FailedAttachVolume",), pod))
    if failed is not None:
        return f"no VolumeAttachment for {pv_name} on {node}: {failed.get('message')}"
    return f"no VolumeAttachment for {pv_name} on {node} yet"


# -- expansion and modification ----------------------------------------------------------------------


def _expansion(snap: Snapshot, steps: list[Step], waiting: list[Waiting]) -> None:
    claim = snap.claim
    spec, status = claim.get("spec") or {}, claim.get("status") or {}
    wanted = parse_quantity(((spec.get("resources") or {}).get("requests") or {}).get("storage"))
    has = parse_quantity((status.get("capacity") or {}).get("storage"))
    started = _events(snap, ("Resizing", "ExternalExpanding"), claim)
    ended = _events(snap, ("FileSystemResizeSuccessful", "VolumeResizeSuccessful"), claim)
    if not started and has >= wanted:
        return
    begun = event_time(started[0]) if started else None
    done = event_time(ended[-1]) if ended and has >= wanted else None
    steps.append(Step("expand", "claim", begun, done))
    if has >= wanted:
        return
    for kind, who in (("ControllerResizeError", "external-resizer"), ("NodeResizeError", "kubelet")):
        c = _condition(claim, kind)
        if c is not None:
            waiting.append(Waiting(who, f"expansion fails: {c.get('message')}"))
            return
    failed = _latest(_events(snap, ("VolumeResizeFailed", "FileSystemResizeFailed"), claim))
    if failed is not None:
        waiting.append(Waiting(str((failed.get("source") or {}).get("component") or "external-resizer"),
                               f"expansion fails: {failed.get('message')}"))  # fmt: skip
        return
    if _condition(claim, "FileSystemResizePending") is not None:
        users = [p for p in snap.pods if not pod_terminated(p) and (p.get("spec") or {}).get("nodeName")]
        if users:
            node = users[0]["spec"]["nodeName"]
            waiting.append(
                Waiting(f"kubelet on {node}", "the volume grew; the node grows its filesystem next")
            )
        else:
            waiting.append(
                Waiting("kubelet", "the volume grew; its filesystem grows when a pod using the claim starts")
            )
        return
    waiting.append(Waiting("external-resizer", f"expanding to {spec['resources']['requests']['storage']}"))


def _modification(snap: Snapshot, steps: list[Step], waiting: list[Waiting]) -> None:
    claim = snap.claim
    spec, status = claim.get("spec") or {}, claim.get("status") or {}
    want = spec.get("volumeAttributesClassName")
    current = status.get("currentVolumeAttributesClassName")
    modify = status.get("modifyVolumeStatus") or {}
    started = _events(snap, ("VolumeModify",), claim)
    if not started and want == current and not modify:
        return
    ended = _events(snap, ("VolumeModifySuccessful",), claim)
    done = event_time(ended[-1]) if ended and want == current and not modify else None
    steps.append(Step("modify", "claim", event_time(started[0]) if started else None, done))
    if want == current and not modify:
        return
    failed = _latest(_events(snap, ("VolumeModifyFailed",), claim))
    detail = f": {failed.get('message')}" if failed is not None else ""
    state = modify.get("status", "Pending")
    if state == "Infeasible":
        reason = f"class {want!r} is infeasible for this volume{detail}; the claim stays on {current!r}"
    elif state == "InProgress":
        reason = f"modifying to class {want!r}{detail}"
    else:
        reason = f"class {want!r} waits{detail or ' (does the VolumeAttributesClass exist?)'}"
    waiting.append(Waiting("external-resizer", reason))
