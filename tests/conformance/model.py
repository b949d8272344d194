"""What a conformance scenario is: a name, where it comes from, and a list of steps, each a plain
value the runner interprets (tests/conformance/runner.py). Scenarios are written with the builders
in tests/conformance/build.py; this module has no I/O.

Names in a scenario are local: the runner gives every scenario its own namespace and puts a prefix
unique to the scenario in front of every cluster-scoped name (PersistentVolumes, StorageClasses),
so scenarios of one mode can share a control plane; the normaliser takes both away again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]

# Short kinds the steps use, and what they stand for.
KINDS = {
    "pv": "PersistentVolume",
    "pvc": "PersistentVolumeClaim",
    "pod": "Pod",
    "sc": "StorageClass",
    "va": "VolumeAttachment",
    "node": "Node",
    "secret": "Secret",
    "vs": "VolumeSnapshot",
    # Named `snapshot:<VolumeSnapshot>` in steps: the content the snapshot-controller bound to it.
    "vsc": "VolumeSnapshotContent",
}
# Components a step can kill or restart, by role. In go mode the three kcm controllers are one
# process (kube-controller-manager), so killing one role kills all three there.
ROLES = (
    "binder",
    "attach-detach",
    "expander",
    "provisioner",
    "attacher",
    "resizer",
    "node-agent-node-a",
    "node-agent-node-b",
)


@dataclass(frozen=True)
class DriverVolume:
    """A volume created straight through the CSI driver's CreateVolume (a pre-provisioned disk);
    its handle is what `{vol:<name>}` in a later object stands for."""

    name: str
    size_mi: int = 16
    block: bool = False


@dataclass(frozen=True)
class Create:
    obj: Obj


@dataclass(frozen=True)
class Patch:
    kind: str
    name: str
    patch: Obj
    subresource: str | None = None


@dataclass(frozen=True)
class Delete:
    kind: str
    name: str
    grace_seconds: int | None = None


@dataclass(frozen=True)
class Condition:
    """A predicate on one object, read from the runner's caches. `path` is a dotted path into the
    object (list items by index); `equals` None with `exists` False means the object is gone."""

    kind: str
    name: str
    path: str = ""
    equals: Any = None
    exists: bool = True
    # For events: the reason one must carry (kind/name is the involved object).
    event_reason: str = ""

    def describe(self) -> str:
        if self.event_reason:
            return f"event {self.event_reason} on {self.kind}/{self.name}"
        if not self.exists:
            return f"{self.kind}/{self.name} gone"
        if not self.path:
            return f"{self.kind}/{self.name} exists"
        return f"{self.kind}/{self.name} {self.path}={self.equals!r}"


@dataclass(frozen=True)
class Wait:
    """Polls until every condition holds or `timeout` passes. A timeout is not an error: it is part
    of the outcome ("wait timed out: ..."), so a mode in which the condition never holds shows up in
    the diff rather than as a crash."""

    conditions: tuple[Condition, ...]
    timeout: float = 60.0


@dataclass(frozen=True)
class Sleep:
    """A bounded pause for a state that must *not* change (nothing to wait for): a negative check."""

    seconds: float


@dataclass(frozen=True)
class Kill:
    role: str


@dataclass(frozen=True)
class Restart:
    role: str


@dataclass(frozen=True)
class Observe:
    """A snapshot of the scenario's objects under `label` (the runner takes a final one itself)."""

    label: str


Step = DriverVolume | Create | Patch | Delete | Wait | Sleep | Kill | Restart | Observe


@dataclass(frozen=True)
class ExpectedDifference:
    """A difference we keep on purpose: why, and the changed lines (`-go` / `+kubeloop` lines of the
    unified diff) it must consist of, so a different divergence in the same scenario still fails."""

    reason: str
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Scenario:
    name: str
    source: str  # the Go test table or behaviour it is drawn from
    steps: tuple[Step, ...]
    # Runs in `make test` as well as `make conformance`.
    subset: bool = False
    # Kills components or changes nodes: runs alone, never beside another scenario.
    exclusive: bool = False
    # Seconds after the last step before the final snapshot.
    settle: float = 2.0
    expected: ExpectedDifference | None = None
    tags: tuple[str, ...] = field(default=())
