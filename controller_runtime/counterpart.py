"""Next to a live kube-controller-manager: whether kcm's counterpart of a kubeloop controller is
writing in this cluster, and standing down when it is.

kubeloop's pv-controller, attach-detach and volume-expand controllers replace three of kcm's
(`persistentvolume-binder-controller`, `persistentvolume-attach-detach-controller`,
`persistentvolume-expander-controller`). Both running means two binders, two attach-detach
controllers, two expanders on the same objects: conflicting writes (409s turned into
`ProvisioningFailed` events), every event twice. Nothing in the API says which controllers a kcm
runs (its `--controllers` flag is seen only on its own /configz), so a controller learns it from
what kcm writes. The rule (`kcm_wrote`, pure) is one for all three, over a `Counterpart` each:

- kcm's writes carry the field manager `kube-controller-manager` (`KCM_MANAGER`, from its user
  agent) in `metadata.managedFields`, operation Update. But that one entry is the union of every
  kcm controller's writes to the object (pvc-protection's finalizers, the garbage collector's
  owner references, the ephemeral-volume controller's creation), and it stays when kcm's storage
  controllers are switched off: objects bound by kcm before kubeloop took over keep it for good.
  So an entry's presence, or its time, proves nothing.
- What proves it is a field that only the counterpart writes, whose value this very write changed,
  and which kcm's entry owns afterwards: with Update operations the apiserver gives a changed field
  to the manager that changed it and takes it from every other, so a changed field kcm owns was
  changed by kcm, now. Values are compared with the copy this process cached before the write;
  objects of the first list are only remembered, never judged (history is not activity).
- Resources the counterpart creates (VolumeAttachments, its Events) count when one appears, after
  the first list, with kcm's entry owning one of the fields.
- kcm's Events carry the counterpart's event source (`persistentvolume-controller`,
  `attachdetach-controller`, `volume_expand`), which kubeloop's controllers use too; their
  manager tells them apart. The expander writes nothing else for a CSI volume (kcm 1.36 sets
  `volume.kubernetes.io/storage-resizer` only for in-tree volumes migrated to CSI), so its Events
  are its only trace; for the other two they are the trace that comes even when kubeloop won every
  race for the objects (kcm's binder says ExternalProvisioning on every sync of a claim waiting for
  a provisioner, kcm's attach-detach SuccessfulAttachVolume once a VolumeAttachment it wanted is
  attached, whoever created it).

`CounterpartGuard` carries the rule out for one process (controller_runtime.component wires it):
raw observers on the controller's informers (`SharedInformer.observe_raw`: the informers drop
managedFields before caching), a watch of its own on the Events of the counterpart's source, and
on the first sighting it stops every write of the controller's API client
(`ApiClient.stop_writes`), records one Warning `KubeControllerManagerActive` on the object where
kcm was seen, logs the kcm flag to turn off and sets `kubeloop_kcm_counterpart_active`. It never
resumes by itself: kcm's silence is not its absence (a quiet cluster gives kcm nothing to write
for hours), so a restart of the kubeloop controller, once kcm's is off, is what resumes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .client import ApiClient
from .events import EventRecorder
from .informer import SharedInformer, SharedInformerFactory
from .logs import get_logger
from .metrics import Gauge
from .resources import (
    EVENTS,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    VOLUME_ATTACHMENTS,
    Obj,
    Resource,
)
from .storage import (
    ANN_BETA_STORAGE_PROVISIONER,
    ANN_BIND_COMPLETED,
    ANN_BOUND_BY_CONTROLLER,
    ANN_STORAGE_PROVISIONER,
)

log = get_logger("counterpart")

KCM_MANAGER = "kube-controller-manager"
REASON = "KubeControllerManagerActive"  # the Warning's reason (docs/contracts.md)
ANN_STORAGE_RESIZER = "volume.kubernetes.io/storage-resizer"

ACTIVE = Gauge(
    "kubeloop_kcm_counterpart_active",
    "1 once kube-controller-manager's counterpart of this controller was seen writing: this "
    "controller then writes nothing until it is restarted",
    ["controller"],
)

FieldPath = tuple[str, ...]


@dataclass(frozen=True)
class Trace:
    """Where a counterpart's writes show on one resource: fields only it writes, and whether a new
    object of this resource with kcm's entry owning one of them is its creation."""

    resource: Resource
    paths: tuple[FieldPath, ...]
    created: bool = False


@dataclass(frozen=True)
class Counterpart:
    controller: str  # the name in kcm's --controllers
    event_source: str  # the source.component of its core/v1 Events
    traces: tuple[Trace, ...] = ()

    @property
    def flag(self) -> str:
        """kcm's flag that turns it off, as kcm's whole --controllers value when all else stays on."""
        return f"--controllers=*,-{self.controller}"

    def trace(self, resource: Resource) -> Trace | None:
        if resource == EVENTS:
            return _EVENT_TRACE
        return next((t for t in self.traces if t.resource == resource), None)


# An Event is written by its recorder alone: created, then its count and lastTimestamp raised.
_EVENT_TRACE = Trace(EVENTS, (("count",), ("lastTimestamp",), ("reason",)), created=True)

BINDER = Counterpart(
    "persistentvolume-binder-controller",
    "persistentvolume-controller",
    (
        Trace(
            PERSISTENT_VOLUMES,
            (
                ("spec", "claimRef"),
                ("status", "phase"),
                ("metadata", "annotations", ANN_BOUND_BY_CONTROLLER),
            ),
        ),
        # Not on creation: the ephemeral-volume controller creates claims as kcm, with whatever
        # its template holds.
        Trace(
            PERSISTENT_VOLUME_CLAIMS,
            (
                ("spec", "volumeName"),
                ("status", "phase"),
                ("metadata", "annotations", ANN_BIND_COMPLETED),
                ("metadata", "annotations", ANN_BOUND_BY_CONTROLLER),
                ("metadata", "annotations", ANN_STORAGE_PROVISIONER),
                ("metadata", "annotations", ANN_BETA_STORAGE_PROVISIONER),
            ),
        ),
    ),
)
ATTACH_DETACH = Counterpart(
    "persistentvolume-attach-detach-controller",
    "attachdetach-controller",
    (
        Trace(VOLUME_ATTACHMENTS, (("spec", "attacher"), ("spec", "nodeName")), created=True),
        Trace(NODES, (("status", "volumesAttached"),)),
    ),
)
EXPANDER = Counterpart(
    "persistentvolume-expander-controller",
    "volume_expand",
    (Trace(PERSISTENT_VOLUME_CLAIMS, (("metadata", "annotations", ANN_STORAGE_RESIZER),)),),
)


@dataclass(frozen=True)
class Sighting:
    """kcm's counterpart caught writing: which object and which of its fields."""

    counterpart: Counterpart
    kind: str
    namespace: str
    name: str
    uid: str
    api_version: str
    fields: tuple[str, ...]  # the dotted paths kcm wrote (none when seen through an Event)
    event: Obj | None = None  # the Event, when kcm was seen through one

    @property
    def subject(self) -> str:
        """The object kcm wrote, or the one its Event is about, as `Kind namespace/name`."""
        if self.event is not None:
            ref = self.event.get("involvedObject") or {}
            return _described(
                str(ref.get("kind", "")), str(ref.get("namespace", "")), str(ref.get("name", ""))
            )
        return _described(self.kind, self.namespace, self.name)

    def what(self) -> str:
        if self.event is not None:
            return f"it recorded the event {self.event.get('reason', '')} about {self.subject}"
        return f"it wrote {', '.join(self.fields)} of {self.subject}"

    def about(self) -> Obj:
        """The object the Warning is recorded on: the one kcm wrote, or the one its Event is about."""
        if self.event is not None:
            ref = self.event.get("involvedObject") or {}
            metadata = {k: ref[k] for k in ("name", "namespace", "uid") if ref.get(k)}
            return {
                "kind": ref.get("kind", ""),
                "apiVersion": ref.get("apiVersion", ""),
                "metadata": metadata,
            }
        metadata = {"name": self.name, "uid": self.uid}
        if self.namespace:
            metadata["namespace"] = self.namespace
        return {"kind": self.kind, "apiVersion": self.api_version, "metadata": metadata}


def _described(kind: str, namespace: str, name: str) -> str:
    return f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}"


def message(sighting: Sighting, controller: str) -> str:
    """The Warning's text and the log line's message: what was seen, what stops, what to do."""
    cp = sighting.counterpart
    return (
        f"kube-controller-manager's {cp.controller} is active ({sighting.what()}): {controller} "
        f"writes nothing more until it is restarted. Run one of the two: turn kcm's off "
        f"({cp.flag}, or add -{cp.controller} to the list kcm has), or stop {controller}"
    )


# -- reading managedFields ---------------------------------------------------------------------------

_ABSENT = object()


def kcm_entries(obj: Obj) -> list[Obj]:
    """The managedFields entries of kube-controller-manager's Update writes (main and status)."""
    return [
        m
        for m in (obj.get("metadata") or {}).get("managedFields") or ()
        if m.get("manager") == KCM_MANAGER and m.get("operation") == "Update"
    ]


def _owned(fields_v1: Any, path: FieldPath) -> Any:
    """The fieldsV1 node of `path` (None when the entry does not own it)."""
    node = fields_v1
    for part in path:
        if not isinstance(node, dict):
            return None
        node = node.get(f"f:{part}")
        if node is None:
            return None
    return node


def _leaves(node: Any, prefix: FieldPath) -> Iterator[FieldPath]:
    """The leaf fields under an owned node, as paths. A list's items (`k:`, `v:`, `i:` keys) and
    a node owning only itself (`.`) are compared whole."""
    if not isinstance(node, dict):
        yield prefix
        return
    children = [k for k in node if k.startswith("f:")]
    if not children or any(k[:2] in ("k:", "v:", "i:") for k in node):
        yield prefix
        return
    for key in children:
        yield from _leaves(node[key], (*prefix, key[2:]))


def _value(obj: Obj | None, path: FieldPath) -> Any:
    node: Any = obj
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def owned_paths(entries: list[Obj], paths: tuple[FieldPath, ...]) -> dict[FieldPath, list[FieldPath]]:
    """Of `paths`, those the entries own, each with the leaf paths owned under it."""
    out: dict[FieldPath, list[FieldPath]] = {}
    for entry in entries:
        fields_v1 = entry.get("fieldsV1") or {}
        for path in paths:
            node = _owned(fields_v1, path)
            if node is not None:
                out.setdefault(path, []).extend(_leaves(node, path))
    return out


def kcm_wrote(counterpart: Counterpart, resource: Resource, old: Obj | None, new: Obj) -> Sighting | None:
    """What of `counterpart`'s fields kube-controller-manager wrote in the change from `old` (the
    copy cached before; None for an object new to the cache) to `new` (as the API served it, with
    managedFields); None when it wrote none of them. See the module's docstring for why."""
    trace = counterpart.trace(resource)
    if trace is None:
        return None
    if resource == EVENTS and (new.get("source") or {}).get("component") != counterpart.event_source:
        return None
    entries = kcm_entries(new)
    if not entries:
        return None
    owned = owned_paths(entries, trace.paths)
    if old is None:
        written = list(owned) if trace.created else []
    else:
        written = [p for p, leaves in owned.items() if any(_value(old, f) != _value(new, f) for f in leaves)]
    if not written:
        return None
    md = new.get("metadata") or {}
    return Sighting(
        counterpart,
        resource.kind,
        str(md.get("namespace") or ""),
        str(md.get("name") or ""),
        str(md.get("uid") or ""),
        resource.api_version,
        () if resource == EVENTS else tuple(".".join(p) for p in written),
        event=new if resource == EVENTS else None,
    )


def writers(counterpart: Counterpart, resource: Resource, obj: Mapping[str, Any]) -> dict[str, list[str]]:
    """Every manager that owns one of `counterpart`'s fields of `obj` (as the API served it), with
    those fields as dotted paths: `kubectl kubeloop` shows kcm and a kubeloop controller both there."""
    trace = counterpart.trace(resource)
    if trace is None:
        return {}
    out: dict[str, list[str]] = {}
    for entry in (obj.get("metadata") or {}).get("managedFields") or ():
        if entry.get("operation") != "Update":
            continue
        for path in owned_paths([entry], trace.paths):
            dotted = ".".join(path)
            fields = out.setdefault(str(entry.get("manager", "")), [])
            if dotted not in fields:
                fields.append(dotted)
    return out


# -- standing down -----------------------------------------------------------------------------------


class CounterpartGuard:
    """One process's watch for its kcm counterpart. `controller` is the process's name (its user
    agent, hence its field manager, and its Warning's source); `client` the API client its
    controller writes with, whose writes stop on the first sighting."""

    def __init__(self, counterpart: Counterpart, controller: str, client: ApiClient) -> None:
        self.counterpart = counterpart
        self.controller = controller
        self.client = client
        self.tripped = asyncio.Event()
        self.sighting: Sighting | None = None
        self._events: SharedInformer | None = None
        self._announcer: ApiClient | None = None
        self._recorder: EventRecorder | None = None
        ACTIVE.labels(counterpart.controller).set(0)

    @property
    def reason(self) -> str | None:
        """Why the controller stands down (its /readyz says so); None while it does not."""
        if self.sighting is None:
            return None
        return (
            f"standing down: kube-controller-manager's {self.counterpart.controller} is active "
            f"(turn it off with {self.counterpart.flag}, then restart {self.controller})"
        )

    @property
    def synced(self) -> bool:
        """Its Events informer has listed (so what it sees from now on is news)."""
        return self._events is None or self._events.has_synced

    def watch(self, factory: SharedInformerFactory) -> None:
        """Observes the counterpart's resources on the controller's informers (before their caches
        drop managedFields), and its Events on an informer of its own, started with `start`."""
        for trace in self.counterpart.traces:
            factory.informer(trace.resource).observe_raw(self._observer(trace.resource))
        self._events = SharedInformer(
            self.client, EVENTS, field_selector=f"source={self.counterpart.event_source}"
        )
        self._events.observe_raw(self._observer(EVENTS))

    def start(self) -> None:
        if self._events is not None:
            self._events.start()

    async def stop(self) -> None:
        """Stops watching (a controller that stood down watches nothing more)."""
        if self._events is not None:
            await self._events.stop()

    async def close(self) -> None:
        await self.stop()
        if self._recorder is not None:
            await self._recorder.close()
        if self._announcer is not None:
            await self._announcer.close()

    def _observer(self, resource: Resource) -> Callable[[Obj | None, Obj], None]:
        def observe(old: Obj | None, new: Obj) -> None:
            if self.sighting is None:
                sighting = kcm_wrote(self.counterpart, resource, old, new)
                if sighting is not None:
                    self.stand_down(sighting)

        return observe

    def stand_down(self, sighting: Sighting) -> None:
        """Stops every write of the controller's client at once (synchronously: nothing the
        controller sends after this leaves the process), then says so, once."""
        self.sighting = sighting
        self.client.stop_writes(self.reason or "")
        ACTIVE.labels(self.counterpart.controller).set(1)
        text = message(sighting, self.controller)
        log.error(
            "kube-controller-manager's counterpart is active, standing down",
            kcm_controller=self.counterpart.controller,
            turn_off=self.counterpart.flag,
            seen=sighting.what(),
            until="restarted",
        )
        # The Warning goes through a client of its own: the controller's writes no longer leave.
        self._announcer = self.client.with_own_limiter()
        self._recorder = EventRecorder(self._announcer, self.controller)
        self._recorder.warning(sighting.about(), REASON, text)
        self.tripped.set()
