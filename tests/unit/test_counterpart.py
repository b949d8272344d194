"""Whether kube-controller-manager's counterpart of a kubeloop controller wrote an object
(controller_runtime.counterpart.kcm_wrote), on managedFields as kube-apiserver 1.36.3 served them
with kcm 1.36.3 running every controller (`--controllers=*`): a static PV and claim bound by kcm's
binder, a dynamic claim handed to a provisioner, a VolumeAttachment kcm created, a Node's
volumesAttached kcm wrote, its Events. Then what must never count: kubeloop's own writes, the
scheduler's, kcm's other controllers (the ttl controller, pvc-protection, the ephemeral-volume
controller), history (kcm's old entries on objects that change for other reasons)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from aiohttp import web
from kubernetes_asyncio.client import Configuration

from controller_runtime.client import ApiClient, WritesStoppedError
from controller_runtime.controller import worker
from controller_runtime.counterpart import (
    ACTIVE,
    ATTACH_DETACH,
    BINDER,
    EXPANDER,
    KCM_MANAGER,
    REASON,
    CounterpartGuard,
    kcm_wrote,
    message,
    writers,
)
from controller_runtime.debug import FAILURES
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.kinds import pvc_view
from controller_runtime.resources import (
    EVENTS,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    VOLUME_ATTACHMENTS,
    Obj,
)
from controller_runtime.workqueue import WorkQueue, default_rate_limiter
from kubectl_kubeloop.diagnose import diagnose, parse_time
from kubectl_kubeloop.render import describe
from kubectl_kubeloop.snapshot import Snapshot
from tests.support.fake_apiserver import serve

T0, T1 = "2026-11-28T13:34:23Z", "2026-11-28T13:34:43Z"


def entry(manager: str, fields: Obj, subresource: str = "", api_version: str = "v1", time: str = T1) -> Obj:
    out: Obj = {
        "manager": manager,
        "operation": "Update",
        "apiVersion": api_version,
        "time": time,
        "fieldsType": "FieldsV1",
        "fieldsV1": fields,
    }
    if subresource:
        out["subresource"] = subresource
    return out


# -- the objects, before and after kcm's binder bound them (captured) --------------------------------

CLAIM_REF_FIELDS: Obj = {
    ".": {},
    "f:apiVersion": {},
    "f:kind": {},
    "f:name": {},
    "f:namespace": {},
    "f:resourceVersion": {},
    "f:uid": {},
}
PV_CREATED = entry(
    "kubeloop",
    {
        "f:spec": {
            "f:accessModes": {},
            "f:capacity": {".": {}, "f:storage": {}},
            "f:csi": {".": {}, "f:driver": {}, "f:volumeHandle": {}},
            "f:persistentVolumeReclaimPolicy": {},
            "f:volumeMode": {},
        }
    },
    time=T0,
)
PV_BOUND_BY_KCM = entry(
    KCM_MANAGER,
    {
        "f:metadata": {"f:annotations": {".": {}, "f:pv.kubernetes.io/bound-by-controller": {}}},
        "f:spec": {"f:claimRef": CLAIM_REF_FIELDS},
    },
)
PV_PHASE_BY_KCM = entry(KCM_MANAGER, {"f:status": {"f:phase": {}}}, subresource="status")
CLAIM_REF = {
    "kind": "PersistentVolumeClaim",
    "namespace": "default",
    "name": "st",
    "uid": "3b04ceae-6639-4a7a-bbcf-1a5be9f146c5",
    "apiVersion": "v1",
    "resourceVersion": "213",
}


def pv(*entries: Obj, claim_ref: Obj | None = None, phase: str = "Available", finalizers: Any = None) -> Obj:
    obj: Obj = {
        "metadata": {
            "name": "pv1",
            "uid": "pv-uid",
            "resourceVersion": "300",
            "finalizers": finalizers or ["kubernetes.io/pv-protection"],
            "managedFields": list(entries),
        },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "capacity": {"storage": "1Gi"},
            "csi": {"driver": "x.example.com", "volumeHandle": "h1"},
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "volumeMode": "Filesystem",
        },
        "status": {"phase": phase},
    }
    if claim_ref is not None:
        obj["spec"]["claimRef"] = dict(claim_ref)
        obj["metadata"]["annotations"] = {"pv.kubernetes.io/bound-by-controller": "yes"}
    return obj


def cached(obj: Obj) -> Obj:
    """The copy an informer keeps: without managedFields."""
    out = copy.deepcopy(obj)
    out["metadata"].pop("managedFields", None)
    return out


CLAIM_CREATED = entry(
    "kubeloop",
    {
        "f:spec": {
            "f:accessModes": {},
            "f:resources": {"f:requests": {".": {}, "f:storage": {}}},
            "f:storageClassName": {},
            "f:volumeMode": {},
        }
    },
    time=T0,
)
CLAIM_PROVISIONER_BY_KCM = entry(
    KCM_MANAGER,
    {
        "f:metadata": {
            "f:annotations": {
                ".": {},
                "f:volume.beta.kubernetes.io/storage-provisioner": {},
                "f:volume.kubernetes.io/storage-provisioner": {},
            }
        }
    },
)
CLAIM_BOUND_BY_KCM = entry(
    KCM_MANAGER,
    {
        "f:metadata": {
            "f:annotations": {
                ".": {},
                "f:pv.kubernetes.io/bind-completed": {},
                "f:pv.kubernetes.io/bound-by-controller": {},
            }
        },
        "f:spec": {"f:volumeName": {}},
    },
)
CLAIM_STATUS_BY_KCM = entry(
    KCM_MANAGER,
    {"f:status": {"f:accessModes": {}, "f:capacity": {".": {}, "f:storage": {}}, "f:phase": {}}},
    subresource="status",
)


def claim(
    *entries: Obj, annotations: dict[str, str] | None = None, volume: str = "", phase: str = "Pending"
) -> Obj:
    obj: Obj = {
        "metadata": {
            "name": "st",
            "namespace": "default",
            "uid": "3b04ceae-6639-4a7a-bbcf-1a5be9f146c5",
            "resourceVersion": "301",
            "finalizers": ["kubernetes.io/pvc-protection"],
            "annotations": dict(annotations or {}),
            "managedFields": list(entries),
        },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
            "storageClassName": "",
            "volumeMode": "Filesystem",
        },
        "status": {"phase": phase},
    }
    if volume:
        obj["spec"]["volumeName"] = volume
    return obj


BOUND = {"pv.kubernetes.io/bind-completed": "yes", "pv.kubernetes.io/bound-by-controller": "yes"}
HANDED = {
    "volume.beta.kubernetes.io/storage-provisioner": "x.example.com",
    "volume.kubernetes.io/storage-provisioner": "x.example.com",
}


def test_kcm_binding_a_volume_is_seen_on_the_volume() -> None:
    before = pv(PV_CREATED, PV_PHASE_BY_KCM)
    after = pv(PV_CREATED, PV_BOUND_BY_KCM, PV_PHASE_BY_KCM, claim_ref=CLAIM_REF)
    seen = kcm_wrote(BINDER, PERSISTENT_VOLUMES, cached(before), after)
    assert seen is not None
    assert seen.fields == ("spec.claimRef", "metadata.annotations.pv.kubernetes.io/bound-by-controller")
    assert (seen.kind, seen.name, seen.namespace, seen.uid) == ("PersistentVolume", "pv1", "", "pv-uid")
    assert seen.what() == (
        "it wrote spec.claimRef, metadata.annotations.pv.kubernetes.io/bound-by-controller "
        "of PersistentVolume pv1"
    )


def test_kcm_writing_a_phase_is_seen_through_the_status_entry() -> None:
    before = pv(PV_CREATED, phase="Pending")
    after = pv(PV_CREATED, PV_PHASE_BY_KCM)
    seen = kcm_wrote(BINDER, PERSISTENT_VOLUMES, cached(before), after)
    assert seen is not None and seen.fields == ("status.phase",)


def test_kcm_binding_and_handing_over_claims_is_seen_on_the_claim() -> None:
    before = claim(CLAIM_CREATED)
    bound = claim(CLAIM_CREATED, CLAIM_BOUND_BY_KCM, annotations=BOUND, volume="pv1")
    seen = kcm_wrote(BINDER, PERSISTENT_VOLUME_CLAIMS, cached(before), bound)
    assert seen is not None
    assert set(seen.fields) == {
        "spec.volumeName",
        "metadata.annotations.pv.kubernetes.io/bind-completed",
        "metadata.annotations.pv.kubernetes.io/bound-by-controller",
    }
    status = claim(
        CLAIM_CREATED, CLAIM_BOUND_BY_KCM, CLAIM_STATUS_BY_KCM, annotations=BOUND, volume="pv1", phase="Bound"
    )
    seen = kcm_wrote(BINDER, PERSISTENT_VOLUME_CLAIMS, cached(bound), status)
    assert seen is not None and seen.fields == ("status.phase",)
    handed = claim(CLAIM_CREATED, CLAIM_PROVISIONER_BY_KCM, annotations=HANDED)
    seen = kcm_wrote(BINDER, PERSISTENT_VOLUME_CLAIMS, cached(before), handed)
    assert seen is not None and len(seen.fields) == 2


def test_history_is_not_activity() -> None:
    """kcm bound these before kubeloop took over: its entries stay, and stay kcm's when kcm's
    pvc-protection takes the finalizer off (one entry for every kcm controller, its time new)."""
    bound = claim(
        CLAIM_CREATED, CLAIM_BOUND_BY_KCM, CLAIM_STATUS_BY_KCM, annotations=BOUND, volume="pv1", phase="Bound"
    )
    unprotected = copy.deepcopy(bound)
    unprotected["metadata"]["finalizers"] = []
    unprotected["metadata"]["deletionTimestamp"] = T1
    for e in unprotected["metadata"]["managedFields"]:
        e["time"] = "2026-11-28T15:00:00Z"
    assert kcm_wrote(BINDER, PERSISTENT_VOLUME_CLAIMS, cached(bound), unprotected) is None
    # A re-list or a resync: the same object again.
    assert kcm_wrote(BINDER, PERSISTENT_VOLUME_CLAIMS, cached(bound), bound) is None
    volume = pv(PV_CREATED, PV_BOUND_BY_KCM, PV_PHASE_BY_KCM, claim_ref=CLAIM_REF, phase="Bound")
    assert kcm_wrote(BINDER, PERSISTENT_VOLUMES, cached(volume), volume) is None


def test_kubeloops_own_writes_never_count() -> None:
    """kubeloop's binder changing fields kcm owned takes them from kcm's entry (the apiserver does
    so for every Update): a released volume's claimRef UID cleared, the phase moved on."""
    before = pv(PV_CREATED, PV_BOUND_BY_KCM, PV_PHASE_BY_KCM, claim_ref=CLAIM_REF, phase="Bound")
    after = copy.deepcopy(before)
    after["spec"]["claimRef"].pop("uid")
    after["status"]["phase"] = "Released"
    kcm_bind = after["metadata"]["managedFields"][1]["fieldsV1"]["f:spec"]["f:claimRef"]
    kcm_bind.pop("f:uid")
    after["metadata"]["managedFields"][2] = entry(
        "kubeloop-pv-controller", {"f:status": {"f:phase": {}}}, "status"
    )
    assert kcm_wrote(BINDER, PERSISTENT_VOLUMES, cached(before), after) is None
    # Everything written by kubeloop's own controller.
    ours = [
        entry("kubeloop-pv-controller", e["fieldsV1"], e.get("subresource", ""))
        for e in (CLAIM_BOUND_BY_KCM, CLAIM_STATUS_BY_KCM)
    ]
    bound = claim(CLAIM_CREATED, *ours, annotations=BOUND, volume="pv1", phase="Bound")
    assert kcm_wrote(BINDER, PERSISTENT_VOLUME_CLAIMS, cached(claim(CLAIM_CREATED)), bound) is None


def test_the_scheduler_and_kcms_other_controllers_never_count() -> None:
    # kube-scheduler binds a static volume for a WaitForFirstConsumer claim and picks a node.
    before = pv(PV_CREATED, PV_PHASE_BY_KCM)
    after = pv(PV_CREATED, PV_PHASE_BY_KCM, claim_ref=CLAIM_REF)
    after["metadata"]["managedFields"].append(entry("kube-scheduler", PV_BOUND_BY_KCM["fieldsV1"]))
    assert kcm_wrote(BINDER, PERSISTENT_VOLUMES, cached(before), after) is None
    # kcm's ephemeral-volume controller creates a claim whose template carries any annotation.
    created = claim(entry(KCM_MANAGER, CLAIM_BOUND_BY_KCM["fieldsV1"]), annotations=BOUND, volume="pv1")
    assert kcm_wrote(BINDER, PERSISTENT_VOLUME_CLAIMS, None, created) is None
    # kcm's ttl controller annotates every Node (captured).
    node_before = node(NODE_CREATED)
    ttl = node(NODE_CREATED, NODE_TTL_BY_KCM, annotations={"node.alpha.kubernetes.io/ttl": "0"})
    assert kcm_wrote(ATTACH_DETACH, NODES, cached(node_before), ttl) is None


# -- attach-detach --------------------------------------------------------------------------------------

NODE_CREATED = entry(
    "kubeloop",
    {
        "f:metadata": {
            "f:annotations": {".": {}, "f:volumes.kubernetes.io/controller-managed-attach-detach": {}}
        }
    },
    time=T0,
)
NODE_TTL_BY_KCM = entry(
    KCM_MANAGER, {"f:metadata": {"f:annotations": {"f:node.alpha.kubernetes.io/ttl": {}}}}
)
NODE_ATTACHED_BY_KCM = entry(KCM_MANAGER, {"f:status": {"f:volumesAttached": {}}}, subresource="status")
ATTACHED = [{"name": "kubernetes.io/csi/x.example.com^h1", "devicePath": ""}]


def node(*entries: Obj, annotations: dict[str, str] | None = None, attached: list[Obj] | None = None) -> Obj:
    obj: Obj = {
        "metadata": {
            "name": "n1",
            "uid": "node-uid",
            "annotations": {
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                **(annotations or {}),
            },
            "managedFields": list(entries),
        },
        "status": {},
    }
    if attached is not None:
        obj["status"]["volumesAttached"] = attached
    return obj


VA_BY_KCM = entry(
    KCM_MANAGER,
    {"f:spec": {"f:attacher": {}, "f:nodeName": {}, "f:source": {"f:persistentVolumeName": {}}}},
    api_version="storage.k8s.io/v1",
)
VA_ATTACHED = entry("csi-attacher", {"f:status": {"f:attached": {}}}, "status", "storage.k8s.io/v1")


def va(*entries: Obj, attached: bool = False) -> Obj:
    return {
        "metadata": {
            "name": "csi-90e439a2fe2c4e2777fdadd54c8ab1dcd2d74998ddb174529df4bfcde7e52cd5",
            "uid": "va-uid",
            "managedFields": list(entries),
        },
        "spec": {"attacher": "x.example.com", "nodeName": "n1", "source": {"persistentVolumeName": "pv1"}},
        "status": {"attached": attached},
    }


def test_a_volume_attachment_kcm_creates_is_seen() -> None:
    seen = kcm_wrote(ATTACH_DETACH, VOLUME_ATTACHMENTS, None, va(VA_BY_KCM))
    assert seen is not None and seen.kind == "VolumeAttachment"
    assert seen.about()["metadata"]["name"].startswith("csi-")
    # The attacher's status write on it later is not kcm's, nor is kubeloop's creation.
    assert (
        kcm_wrote(
            ATTACH_DETACH,
            VOLUME_ATTACHMENTS,
            cached(va(VA_BY_KCM)),
            va(VA_BY_KCM, VA_ATTACHED, attached=True),
        )
        is None
    )
    ours = entry("kubeloop-attach-detach-controller", VA_BY_KCM["fieldsV1"], api_version="storage.k8s.io/v1")
    assert kcm_wrote(ATTACH_DETACH, VOLUME_ATTACHMENTS, None, va(ours)) is None
    # The binder does not look at VolumeAttachments.
    assert kcm_wrote(BINDER, VOLUME_ATTACHMENTS, None, va(VA_BY_KCM)) is None


def test_kcm_writing_volumes_attached_is_seen() -> None:
    before = node(NODE_CREATED, NODE_TTL_BY_KCM, annotations={"node.alpha.kubernetes.io/ttl": "0"})
    after = node(
        NODE_CREATED,
        NODE_TTL_BY_KCM,
        NODE_ATTACHED_BY_KCM,
        annotations={"node.alpha.kubernetes.io/ttl": "0"},
        attached=ATTACHED,
    )
    seen = kcm_wrote(ATTACH_DETACH, NODES, cached(before), after)
    assert seen is not None and seen.fields == ("status.volumesAttached",)
    # The node agent's (kubelet's) status write later, the list unchanged: nothing.
    later = copy.deepcopy(after)
    later["status"]["volumesInUse"] = ["kubernetes.io/csi/x.example.com^h1"]
    assert kcm_wrote(ATTACH_DETACH, NODES, cached(after), later) is None


# -- Events ---------------------------------------------------------------------------------------------

EVENT_FIELDS: Obj = {
    "f:count": {},
    "f:firstTimestamp": {},
    "f:involvedObject": {},
    "f:lastTimestamp": {},
    "f:message": {},
    "f:reason": {},
    "f:reportingComponent": {},
    "f:source": {"f:component": {}},
    "f:type": {},
}


def event(manager: str, source: str, reason: str, count: int = 1, last: str = T1) -> Obj:
    return {
        "metadata": {
            "name": "dyn.187c1a2b3c4d5e6f",
            "namespace": "default",
            "uid": "event-uid",
            "managedFields": [entry(manager, EVENT_FIELDS)],
        },
        "involvedObject": {
            "kind": "PersistentVolumeClaim",
            "namespace": "default",
            "name": "dyn",
            "uid": "dd089976-6419-4065-b18d-b85aecf723a6",
            "apiVersion": "v1",
            "resourceVersion": "261",
        },
        "reason": reason,
        "message": "waiting",
        "source": {"component": source},
        "count": count,
        "firstTimestamp": T0,
        "lastTimestamp": last,
        "type": "Normal",
        "reportingComponent": source,
        "reportingInstance": "",
    }


def test_kcms_events_are_seen_and_name_what_they_are_about() -> None:
    created = event(KCM_MANAGER, "persistentvolume-controller", "ExternalProvisioning")
    seen = kcm_wrote(BINDER, EVENTS, None, created)
    assert seen is not None
    assert seen.what() == "it recorded the event ExternalProvisioning about PersistentVolumeClaim default/dyn"
    assert seen.about()["kind"] == "PersistentVolumeClaim"
    assert seen.about()["metadata"] == {
        "name": "dyn",
        "namespace": "default",
        "uid": "dd089976-6419-4065-b18d-b85aecf723a6",
    }
    # Its repeat: the count raised.
    again = event(
        KCM_MANAGER, "persistentvolume-controller", "ExternalProvisioning", 2, "2026-11-28T13:35:00Z"
    )
    assert kcm_wrote(BINDER, EVENTS, cached(created), again) is not None
    # The same Event again (a re-list, its deletion at the end of its TTL): nothing new.
    assert kcm_wrote(BINDER, EVENTS, cached(again), again) is None
    expanding = event(KCM_MANAGER, "volume_expand", "ExternalExpanding")
    assert kcm_wrote(EXPANDER, EVENTS, None, expanding) is not None
    attached = event(KCM_MANAGER, "attachdetach-controller", "SuccessfulAttachVolume")
    assert kcm_wrote(ATTACH_DETACH, EVENTS, None, attached) is not None


def test_events_of_kubeloop_and_of_other_sources_never_count() -> None:
    ours = event("kubeloop-pv-controller", "persistentvolume-controller", "ExternalProvisioning")
    assert kcm_wrote(BINDER, EVENTS, None, ours) is None
    registered = event(KCM_MANAGER, "node-controller", "RegisteredNode")
    assert kcm_wrote(BINDER, EVENTS, None, registered) is None
    # One counterpart's source is not another's.
    assert kcm_wrote(EXPANDER, EVENTS, None, event(KCM_MANAGER, "persistentvolume-controller", "X")) is None


def test_writers_show_both_managers_on_the_bind_fields() -> None:
    fought = claim(
        CLAIM_CREATED,
        CLAIM_PROVISIONER_BY_KCM,
        entry("kubeloop-pv-controller", {"f:status": {"f:phase": {}}}, "status"),
        annotations=HANDED,
    )
    assert writers(BINDER, PERSISTENT_VOLUME_CLAIMS, fought) == {
        KCM_MANAGER: [
            "metadata.annotations.volume.kubernetes.io/storage-provisioner",
            "metadata.annotations.volume.beta.kubernetes.io/storage-provisioner",
        ],
        "kubeloop-pv-controller": ["status.phase"],
    }
    assert writers(BINDER, VOLUME_ATTACHMENTS, va(VA_BY_KCM)) == {}


def test_the_message_names_the_flag_and_the_way_back() -> None:
    seen = kcm_wrote(
        BINDER, PERSISTENT_VOLUMES, cached(pv(PV_CREATED, phase="Pending")), pv(PV_CREATED, PV_PHASE_BY_KCM)
    )
    assert seen is not None
    assert message(seen, "kubeloop-pv-controller") == (
        "kube-controller-manager's persistentvolume-binder-controller is active (it wrote status.phase "
        "of PersistentVolume pv1): kubeloop-pv-controller writes nothing more until it is restarted. "
        "Run one of the two: turn kcm's off (--controllers=*,-persistentvolume-binder-controller, or add "
        "-persistentvolume-binder-controller to the list kcm has), or stop kubeloop-pv-controller"
    )


# -- the guard: an informer's raw objects in, writes stopped, the metric and the Warning out ------------


class Recorded(ApiClient):
    """A client that keeps the requests it is asked to send instead of sending them (its writes
    stop as ApiClient's do); the clients it makes with with_own_limiter are Recorded too."""

    def __init__(self) -> None:
        cfg = Configuration()
        cfg.host = "http://127.0.0.1:1"
        super().__init__(cfg, qps=0, burst=1)
        self.sent: list[tuple[str, str, Any]] = []
        self.children: list[Recorded] = []

    def with_own_limiter(self) -> ApiClient:
        child = Recorded()
        self.children.append(child)
        return child

    async def request(self, method: str, path: str, **kw: Any) -> Obj:
        if self._writes_stopped is not None and method != "GET":
            raise WritesStoppedError(path)
        self.sent.append((method, path, kw.get("body")))
        return {**(kw.get("body") or {}), "metadata": {"name": "e", "namespace": "default"}}


def named(obj: Obj, name: str) -> Obj:
    obj["metadata"].update(name=name, uid=f"{name}-uid")
    return obj


async def test_the_guard_stops_writes_and_says_so_once() -> None:
    client = Recorded()
    guard = CounterpartGuard(BINDER, "kubeloop-pv-controller", client)
    factory = SharedInformerFactory(client)
    guard.watch(factory)  # observes the controller's informers of the binder's resources
    informer = factory.informer(PERSISTENT_VOLUMES)
    admit = informer.reflector.transform
    assert admit is not None
    # The first list: only remembered, even with kcm's entries on it. Then a volume is created.
    informer.on_replace([admit(pv(PV_CREATED, PV_BOUND_BY_KCM, claim_ref=CLAIM_REF))], "1")
    informer.on_event("ADDED", admit(named(pv(PV_CREATED, phase="Pending"), "pv2")))
    assert guard.sighting is None and not guard.tripped.is_set() and guard.reason is None
    assert ACTIVE.labels(BINDER.controller).value == 0
    # kcm's binder makes it Available.
    informer.on_event("MODIFIED", admit(named(pv(PV_CREATED, PV_PHASE_BY_KCM), "pv2")))
    assert guard.tripped.is_set() and guard.sighting is not None
    assert guard.sighting.subject == "PersistentVolume pv2"
    assert ACTIVE.labels(BINDER.controller).value == 1
    assert guard.reason == (
        "standing down: kube-controller-manager's persistentvolume-binder-controller is active (turn it "
        "off with --controllers=*,-persistentvolume-binder-controller, then restart kubeloop-pv-controller)"
    )
    cached_copy = informer.store.get("pv2")
    assert cached_copy is not None and "managedFields" not in cached_copy["metadata"]
    with pytest.raises(WritesStoppedError):
        await client.update(PERSISTENT_VOLUMES, pv(PV_CREATED))
    # A second sighting says nothing more; the Warning left once, through a client of its own.
    bound = named(pv(PV_CREATED, PV_BOUND_BY_KCM, PV_PHASE_BY_KCM, claim_ref=CLAIM_REF, phase="Bound"), "pv2")
    informer.on_event("MODIFIED", admit(bound))
    assert guard.sighting.subject == "PersistentVolume pv2" and guard.sighting.fields == ("status.phase",)
    await guard.close()
    (announcer,) = client.children
    ((method, path, body),) = announcer.sent
    assert (method, path) == ("POST", "/api/v1/namespaces/default/events")
    assert (body["type"], body["reason"]) == ("Warning", REASON)
    assert body["message"] == message(guard.sighting, "kubeloop-pv-controller")
    assert body["involvedObject"] == {
        "kind": "PersistentVolume",
        "apiVersion": "v1",
        "name": "pv2",
        "uid": "pv2-uid",
    }
    assert body["source"]["component"] == "kubeloop-pv-controller"
    assert client.sent == []


async def test_a_stopped_client_sends_no_write_and_still_reads() -> None:
    seen: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.method)
        return web.json_response({"metadata": {"name": "x"}})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    async with serve(app) as client:
        await client.create(EVENTS, {"metadata": {"namespace": "default"}})
        client.stop_writes("standing down: kube-controller-manager's binder is active")
        for call in (
            client.create(EVENTS, {"metadata": {"namespace": "default"}}),
            client.update(PERSISTENT_VOLUMES, {"metadata": {"name": "pv1"}}),
            client.patch(NODES, "n1", {}, subresource="status"),
            client.delete(VOLUME_ATTACHMENTS, "va"),
        ):
            with pytest.raises(WritesStoppedError, match="not sent: standing down"):
                await call
        await client.get(PERSISTENT_VOLUMES, "pv1")
        # A client of its own (the Warning's, the Lease's) still writes.
        other = client.with_own_limiter()
        try:
            await other.create(EVENTS, {"metadata": {"namespace": "default"}})
        finally:
            await other.close()
    assert seen == ["POST", "GET", "POST"]


# -- kubectl kubeloop: who else is on the job ----------------------------------------------------------


def test_describe_names_a_stand_down_and_both_binders_on_the_claim() -> None:
    fought = claim(
        CLAIM_CREATED,
        CLAIM_PROVISIONER_BY_KCM,
        entry("kubeloop-pv-controller", {"f:status": {"f:phase": {}}}, "status"),
        annotations=HANDED,
    )
    fought["metadata"]["creationTimestamp"] = T0
    warning = event("kubeloop-attach-detach-controller", "kubeloop-attach-detach-controller", REASON)
    warning["message"] = "kube-controller-manager's persistentvolume-attach-detach-controller is active (...)"
    report = diagnose(Snapshot(pvc_view(fought), stand_downs=[warning]))
    stand_down, both = report.control_plane
    assert stand_down.component == "kubeloop-attach-detach-controller"
    assert stand_down.reason == f"stands down since {T1}: {warning['message']}"
    assert (
        both.component
        == "kube-controller-manager's persistentvolume-binder-controller and kubeloop-pv-controller"
    )
    assert both.reason == (
        "both wrote this claim's objects (kube-controller-manager: PersistentVolumeClaim default/st "
        "metadata.annotations.volume.kubernetes.io/storage-provisioner, "
        "metadata.annotations.volume.beta.kubernetes.io/storage-provisioner; kubeloop-pv-controller: "
        "PersistentVolumeClaim default/st status.phase): run one of the two, kcm's turns off with "
        "--controllers=*,-persistentvolume-binder-controller"
    )
    assert report.to_json(parse_time(T1))["control_plane"][0]["component"] == stand_down.component
    text = describe(report, parse_time(T1))
    assert "\nControl plane:\n  kubeloop-attach-detach-controller: stands down since" in text
    # kcm alone, or kubeloop alone, on the claim: nothing to say.
    alone = claim(CLAIM_CREATED, CLAIM_BOUND_BY_KCM, CLAIM_STATUS_BY_KCM, annotations=BOUND, volume="pv1")
    alone["metadata"]["creationTimestamp"] = T0
    assert diagnose(Snapshot(pvc_view(alone))).control_plane == []


async def test_a_worker_whose_writes_stopped_ends_without_a_retry() -> None:
    queue: WorkQueue[str] = WorkQueue("stood-down-test", default_rate_limiter())
    synced: list[str] = []

    async def sync(key: str) -> float | None:
        synced.append(key)
        raise WritesStoppedError(f"PUT {key}: not sent: standing down")

    queue.add("ns/claim")
    queue.add("ns/other")
    await worker(queue, sync)  # returns: nothing it could do would be written
    assert synced == ["ns/claim"]
    assert "stood-down-test" not in FAILURES.snapshot()["queues"]
    assert queue.num_requeues("ns/claim") == 0 and len(queue) == 1
    queue.shutdown()
