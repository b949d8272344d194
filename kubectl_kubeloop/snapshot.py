"""What `kubectl kubeloop` reads: a claim and everything its volume's life touches, in one read of
the API (claim → class → PV → VolumeAttachments → pods → nodes → the events of all of them)."""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass, field

from controller_runtime import counterpart
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.kinds import pod_view
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
    claim: Obj
    storage_class: Obj | None = None
    volume: Obj | None = None
    attachments: list[Obj] = field(default_factory=list)  # the PV's VolumeAttachments
    pods: list[Obj] = field(default_factory=list)  # pods of the claim's namespace that use it
    nodes: dict[str, Obj] = field(default_factory=dict)  # the pods' and attachments' nodes
    csi_driver: Obj | None = None
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


async def _events_of(api: ApiClient, obj: Obj) -> list[Obj]:
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
    claim = await api.get(PERSISTENT_VOLUME_CLAIMS, name, namespace)
    snap = Snapshot(claim)
    spec = claim.get("spec") or {}
    volume_name = str(spec.get("volumeName") or "")
    class_name = spec.get("storageClassName")
    pods_page, volume, storage_class = await asyncio.gather(
        api.list_page(PODS, namespace),
        _get(api, PERSISTENT_VOLUMES, volume_name),
        _get(api, STORAGE_CLASSES, str(class_name or "")),
    )
    snap.volume, snap.storage_class = volume, storage_class
    snap.pods = [
        p for p in pods_page.get("items") or [] if any(c == name for _, c, _ in pod_claims(pod_view(p)))
    ]
    driver = ((volume or {}).get("spec") or {}).get("csi", {}).get("driver") or (storage_class or {}).get(
        "provisioner", ""
    )
    if volume is not None:
        vas = await api.list_page(VOLUME_ATTACHMENTS)
        snap.attachments = [
            va
            for va in vas.get("items") or []
            if (va.get("spec") or {}).get("source", {}).get("persistentVolumeName") == volume_name
        ]
    node_names = {p["spec"].get("nodeName") for p in snap.pods} | {
        va["spec"].get("nodeName") for va in snap.attachments
    }
    nodes = await asyncio.gather(*(_get(api, NODES, str(n)) for n in sorted(n for n in node_names if n)))
    snap.nodes = {n["metadata"]["name"]: n for n in nodes if n is not None}
    snap.csi_driver = await _get(api, CSI_DRIVERS, str(driver))
    about = [claim, *([volume] if volume else []), *snap.attachments, *snap.pods]
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
