"""The normaliser and the comparator: what a scenario's run left behind (the raw objects and events
the runner recorded) becomes a stable, readable document, and two documents (go, kubeloop) become
a verdict with a unified diff.

Normalised away: names the runner made unique (the scenario's namespace and prefix), UIDs (written
as `uid(<Kind>/<name>)` of the object they belong to), volume handles (`vol(<pv>)`), the
VolumeAttachment names derived from them (`csi(<pv>@<node>)`), generated PV names (`pvc-<uid>` of a
claim becomes `pvc-uid(PersistentVolumeClaim/<claim>)`), timestamps and resource versions.

Events: the API server aggregates repeats into one Event with a count, and how often a controller
retries is timing, not behaviour; so per involved object and reporting component the outcome is
the ordered sequence of distinct (type, reason, message) in the order each first appeared, except
that consecutive events of one reason are sorted: they come from independent operations of the
same kind (a pod's two volumes attached at once), whose order is a race in both modes.
"""

from __future__ import annotations

import difflib
import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

from controller_runtime.volumes import va_name
from csi_driver import DRIVER_NAME

from .model import ExpectedDifference, Obj

NODES = ("node-a", "node-b")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_HANDLE = re.compile(r"vol-[0-9a-f]{32}")
_VA = re.compile(r"csi-[0-9a-f]{64}")
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})")


@dataclass
class RawOutcome:
    """What the runner recorded for one scenario in one mode."""

    scenario: str
    namespace: str
    prefix: str  # in front of every cluster-scoped name of the scenario
    timeline: list[str] = field(default_factory=list)  # one line per step that reports something
    snapshots: dict[str, list[Obj]] = field(default_factory=dict)  # label -> the objects then
    events: list[Obj] = field(default_factory=list)  # core/v1 Events in the order the watch saw them
    seen: list[Obj] = field(default_factory=list)  # the last version of every object ever seen


@dataclass(frozen=True)
class Verdict:
    scenario: str
    status: str  # "identical", "differ" or "expected-difference"
    diff: str  # the unified diff (go → kubeloop), empty when identical
    expected_reason: str = ""


class Normaliser:
    """String rewriting for one RawOutcome: tokens found in its objects → stable symbols."""

    def __init__(self, raw: RawOutcome) -> None:
        self.raw = raw
        self.tokens: dict[str, str] = {}
        objs = list(raw.seen)
        for snap in raw.snapshots.values():
            objs.extend(snap)
        # Non-PV UIDs first: a dynamically provisioned PV is named after its claim's UID.
        for obj in objs:
            if obj.get("kind") != "PersistentVolume":
                self._uid(obj)
        for obj in objs:
            if obj.get("kind") == "PersistentVolume":
                self._uid(obj)
                handle = ((obj.get("spec") or {}).get("csi") or {}).get("volumeHandle")
                if handle:
                    pv = self.text(obj["metadata"]["name"])
                    self.tokens.setdefault(handle, f"vol({pv})")
                    for node in NODES:
                        self.tokens.setdefault(va_name(handle, DRIVER_NAME, node), f"csi({pv}@{node})")

    def _uid(self, obj: Obj) -> None:
        md = obj.get("metadata") or {}
        uid = md.get("uid")
        if uid and uid not in self.tokens:
            self.tokens[uid] = f"uid({obj.get('kind')}/{self.text(md.get('name', ''))})"

    def text(self, s: str) -> str:
        # Longest first: a VA name must not be half-rewritten by a shorter token inside it.
        for token, symbol in sorted(self.tokens.items(), key=lambda kv: -len(kv[0])):
            if token in s:
                s = s.replace(token, symbol)
        if self.raw.prefix:
            s = s.replace(self.raw.prefix, "")
        s = re.sub(rf"\b{re.escape(self.raw.namespace)}\b", "NS", s)
        s = _VA.sub("csi-<?>", s)
        s = _HANDLE.sub("vol-<?>", s)
        s = _UUID.sub("<uuid>", s)
        return _TIME.sub("<time>", s)

    def value(self, v: Any) -> Any:
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, dict):
            return {self.text(k): self.value(x) for k, x in v.items()}
        if isinstance(v, list):
            return [self.value(x) for x in v]
        return v


def _pick(obj: Obj, paths: Iterable[str]) -> Obj:
    out: Obj = {}
    for path in paths:
        cur: Any = obj
        for part in path.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur not in (None, {}, []):
            out[path] = cur
    return out


_META = ("metadata.annotations", "metadata.finalizers")
_VIEWS: dict[str, tuple[str, ...]] = {
    "PersistentVolume": (
        *_META,
        "spec.claimRef.namespace",
        "spec.claimRef.name",
        "spec.claimRef.uid",
        "spec.storageClassName",
        "spec.persistentVolumeReclaimPolicy",
        "spec.capacity",
        "spec.accessModes",
        "spec.volumeMode",
        "spec.csi.driver",
        "spec.csi.volumeHandle",
        "spec.csi.fsType",
        "spec.csi.controllerPublishSecretRef",
        "spec.csi.nodeStageSecretRef",
        "spec.csi.nodePublishSecretRef",
        "spec.csi.controllerExpandSecretRef",
        "spec.csi.nodeExpandSecretRef",
        "spec.mountOptions",
        "status.phase",
        "status.reason",
        "status.message",
    ),
    "PersistentVolumeClaim": (
        *_META,
        "spec.volumeName",
        "spec.storageClassName",
        "spec.resources.requests",
        "spec.accessModes",
        "spec.volumeMode",
        "status.phase",
        "status.capacity",
        "status.accessModes",
        "status.allocatedResources",
        "status.allocatedResourceStatuses",
    ),
    "VolumeAttachment": (
        *_META,
        "spec.attacher",
        "spec.nodeName",
        "spec.source",
        "status.attached",
        "status.attachError.message",
        "status.detachError.message",
    ),
    "Pod": ("spec.nodeName", "status.phase"),
    # The provisioner's source-protection finalizer comes and goes on a restore's snapshot.
    "VolumeSnapshot": ("metadata.finalizers", "status.readyToUse"),
}


def view(obj: Obj, norm: Normaliser) -> Obj:
    kind = obj.get("kind", "")
    out = _pick(obj, _VIEWS.get(kind, ()))
    md = obj.get("metadata") or {}
    if md.get("deletionTimestamp"):
        out["metadata.deletionTimestamp"] = "<set>"
    status = obj.get("status") or {}
    if kind == "PersistentVolume" and status.get("lastPhaseTransitionTime"):
        out["status.lastPhaseTransitionTime"] = "<set>"
    if kind == "PersistentVolumeClaim" and status.get("conditions"):
        out["status.conditions"] = [
            {k: c[k] for k in ("type", "status", "reason", "message") if c.get(k)}
            for c in status["conditions"]
        ]
    if kind == "Node":
        # Sorted once normalised: the raw handles are random, their symbols are not.
        attached = [norm.text(v["name"]) for v in status.get("volumesAttached") or ()]
        out["status.volumesAttached"] = sorted(attached)
    return dict(sorted(norm.value(out).items()))


# A provisioner's event source ends in its instance identity (`<driver>_<host>_<uuid>` in the Go
# sidecar): an arbitrary per-process value, so only the part before it is compared.
_INSTANCE = re.compile(r"_<uuid>$")
# An optimistic-concurrency conflict a controller reported and retried: when one happens is timing.
_CONFLICT = "the object has been modified"


def event_source(ev: Obj, norm: Normaliser) -> str:
    source = (ev.get("source") or {}).get("component") or ev.get("reportingComponent") or ""
    return _INSTANCE.sub("", norm.text(str(source)))


def event_line(ev: Obj, norm: Normaliser) -> str:
    return norm.text(f"{ev.get('type')} {ev.get('reason')}: {ev.get('message', '')}")


def normalise(raw: RawOutcome) -> Obj:
    """The comparable document of one run of one scenario."""
    norm = Normaliser(raw)
    snapshots: Obj = {}
    for label, objs in raw.snapshots.items():
        snap: Obj = {}
        for obj in objs:
            key = f"{obj.get('kind')}/{norm.text(obj['metadata']['name'])}"
            v = view(obj, norm)
            if obj.get("kind") == "Node" and not v.get("status.volumesAttached"):
                continue
            snap[key] = v
        snapshots[label] = dict(sorted(snap.items()))
    # Per object and per reporting component: two components' events about one object race each
    # other, while one component's order is its behaviour.
    events: dict[str, dict[str, list[str]]] = {}
    for ev in raw.events:
        if _CONFLICT in str(ev.get("message", "")):
            continue
        ref = ev.get("involvedObject") or {}
        key = f"{ref.get('kind')}/{norm.text(ref.get('name', ''))}"
        line = event_line(ev, norm)
        seq = events.setdefault(key, {}).setdefault(event_source(ev, norm), [])
        if line not in seq:
            seq.append(line)
    return {
        "timeline": [norm.text(t) for t in raw.timeline],
        "snapshots": snapshots,
        "events": {
            k: {source: same_reason_sorted(seq) for source, seq in sorted(v.items())}
            for k, v in sorted(events.items())
        },
    }


def same_reason_sorted(seq: list[str]) -> list[str]:
    """Each run of consecutive lines with one type and reason sorted; the runs keep their order."""
    runs = itertools.groupby(seq, key=lambda line: line.split(":", 1)[0])
    return [line for _, run in runs for line in sorted(run)]


def render(doc: Obj) -> list[str]:
    text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=200, allow_unicode=True)
    return text.splitlines()


def changed_lines(diff: str) -> set[str]:
    """The -/+ lines of a unified diff, without its header, stripped of indentation after the sign."""
    out = set()
    for line in diff.splitlines():
        if line.startswith(("---", "+++", "@@")):
            continue
        if line[:1] in "-+":
            out.add(line[0] + line[1:].strip())
    return out


def compare(scenario: str, go: Obj, kubeloop: Obj, expected: ExpectedDifference | None = None) -> Verdict:
    diff = "\n".join(difflib.unified_diff(render(go), render(kubeloop), "go", "kubeloop", n=4, lineterm=""))
    if not diff:
        return Verdict(scenario, "identical", "")
    if expected is not None:
        want = {line[0] + line[1:].strip() for line in expected.lines}
        if changed_lines(diff) == want:
            return Verdict(scenario, "expected-difference", diff, expected.reason)
    return Verdict(scenario, "differ", diff)
