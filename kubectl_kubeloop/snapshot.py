"""What `kubectl kubeloop` reads: a claim and everything its volume's life touches, in one read of
the API (claim → class → PV → VolumeAttachments → pods → nodes → the events of all of them)."""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass, field

from controller_runtime import counterpart
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.kinds import (
    CSIDriver,
    KubeObject,
    Node,
    PersistentVolume,
    PersistentVolumeClaim,
    Pod,
    StorageClass,
    VolumeAttachment,
    csi_driver_view,
    node_view,
    pod_view,
    pv_view,
    pvc_view,
    storage_class_view,
    volume_attachment_view,
)
from controller_runtime.resources import (
    CSI_DRIVERS,
    EVENTS,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    STORAGE_CLASSES,
    VOLUME_ATTACHMENTS,
    Obj,
    Resource,
)
from controller_runtime.volumes import pod_claims


@dataclass
class Snapshot:
    """The objects as the API served them, seen through their typed views (controller_runtime.kinds),
    which `take` converts them to as it reads them."""

    claim: PersistentVolumeClaim
    storage_class: StorageClass | None = None
    volume: PersistentVolume | None = None
    attachments: list[VolumeAttachment] = field(default_factory=list)  # the PV's VolumeAttachments
    pods: list[Pod] = field(default_factory=list)  # pods of the claim's namespace that use it
    nodes: dict[str, Node] = field(default_factory=dict)  # the pods' and attachments' nodes
    csi_driver: CSIDriver | None = None
    events: list[Obj] = field(default_factory=list)  # of all the above, oldest first
    # Every KubeControllerManagerActive Warning in the cluster: a kubeloop controller that stood
    # down for its kcm counterpart (controller_runtime.counterpart), whatever object it was seen on.
    stand_downs: list[Obj] = field(default_factory=list)
    now: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))

    @property
    def namespace(self) -> str:
        return str(self.claim["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.claim["metadata"]["name"])


async def _get(api: ApiClient, res: Resource, name: str, namespace: str | None = None) -> Obj | None:
    if not name:
        return None
    try:
        return await api.get(res, name, namespace)
    except ApiError as e:
        if e.not_found:
            return None
        raise


async def _events_of(api: ApiClient, obj: KubeObject) -> list[Obj]:
    """The core Events about `obj` (cluster-scoped objects' events live in `default`)."""
    md = obj["metadata"]
    page = await api.list_page(
        EVENTS, md.get("namespace") or "default", fieldSelector=f"involvedObject.uid={md['uid']}"
    )
    return list(page.get("items") or [])


def event_time(event: Obj) -> str:
    return str(
        event.get("lastTimestamp")
        or (event.get("series") or {}).get("lastObservedTime")
        or event.get("eventTime")
        or event.get("firstTimestamp")
        or event["metadata"].get("creationTimestamp")
        or ""
    )


async def take(api: ApiClient, namespace: str, name: str) -> Snapshot:
    """Reads the claim `namespace/name` and what hangs off it; ApiError(404) when there is none."""
    claim = pvc_view(await api.get(PERSISTENT_VOLUME_CLAIMS, name, namespace))
    snap = Snapshot(claim)
    spec = claim.get("spec") or {}
    volume_name = str(spec.get("volumeName") or "")
    class_name = spec.get("storageClassName")
    pods_page, pv, sc = await asyncio.gather(
        api.list_page(PODS, namespace),
        _get(api, PERSISTENT_VOLUMES, volume_name),
        _get(api, STORAGE_CLASSES, str(class_name or "")),
    )
    volume, storage_class = pv_view(pv), storage_class_view(sc)
    snap.volume, snap.storage_class = volume, storage_class
    pods = [pod_view(p) for p in pods_page.get("items") or []]
    snap.pods = [p for p in pods if any(c == name for _, c, _ in pod_claims(p))]
    driver = ((volume or {}).get("spec") or {}).get("csi", {}).get("driver") or (storage_class or {}).get(
        "provisioner", ""
    )
    if volume is not None:
        vas = await api.list_page(VOLUME_ATTACHMENTS)
        attachments = [volume_attachment_view(va) for va in vas.get("items") or []]
        snap.attachments = [
            va
            for va in attachments
            if (va.get("spec") or {}).get("source", {}).get("persistentVolumeName") == volume_name
        ]
    node_names = {p["spec"].get("nodeName") for p in snap.pods} | {
        va["spec"].get("nodeName") for va in snap.attachments
    }
    nodes = await asyncio.gather(*(_get(api, NODES, str(n)) for n in sorted(n for n in node_names if n)))
    snap.nodes = {n["metadata"]["name"]: node_view(n) for n in nodes if n is not None}
    snap.csi_driver = csi_driver_view(await _get(api, CSI_DRIVERS, str(driver)))
    about: list[KubeObject] = [claim, *([volume] if volume else []), *snap.attachments, *snap.pods]
    lists = await asyncio.gather(*(_events_of(api, o) for o in about))
    snap.events = sorted((e for events in lists for e in events), key=event_time)
    try:
        page = await api.list_page(EVENTS, None, fieldSelector=f"reason={counterpart.REASON}")
    except ApiError as e:
        if not e.forbidden:  # a role that may read only the claim's namespace: nothing to add
            raise
    else:
        snap.stand_downs = sorted(page.get("items") or [], key=event_time)
    return snap
