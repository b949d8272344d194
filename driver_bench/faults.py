"""The faults a campaign injects inside a driver's calls, and the sweep of each over every call of
the lifecycle.

Each is something the driver meets in a cluster: the node losing power mid-call (kill -9 before
the driver sees the call, or after it did the work but before the caller got the answer), a
sidecar's deadline expiring while the driver still works (gRPC cancels the call on the driver's
side, as a Go driver's context is cancelled), two copies of one call at once (a sidecar restarted
mid-call, two kubelet workers), an answer lost on the way back. The caller then retries, as the
sidecars and kubelet do, so what each fault tests is the retry: idempotency, and state that
survives a restart."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kubeloop_grpc.csi import csi_pb2

from . import messages

# The steps a fault may be injected at: the lifecycle's calls, in order. A restore is CreateVolume
# with a snapshot as its source, told apart by `step_of`.
STEPS = (
    "CreateVolume",
    "ControllerPublishVolume",
    "NodeStageVolume",
    "NodePublishVolume",
    "ControllerExpandVolume",
    "NodeExpandVolume",
    "CreateSnapshot",
    "CreateVolumeFromSnapshot",
    "NodeUnpublishVolume",
    "NodeUnstageVolume",
    "ControllerUnpublishVolume",
    "DeleteSnapshot",
    "DeleteVolume",
)


def step_of(method: str, request: bytes) -> str:
    """The lifecycle step a raw call is: its method's short name, or CreateVolumeFromSnapshot."""
    short = messages.short_name(method)
    if short == "CreateVolume" and messages.known(method):
        req = messages.decode(method, request)
        assert isinstance(req, csi_pb2.CreateVolumeRequest)
        if req.volume_content_source.HasField("snapshot"):
            return "CreateVolumeFromSnapshot"
    return short


class FaultKind(enum.StrEnum):
    KILL_BEFORE = "kill-before"  # kill -9 of the serving process before forwarding the call
    KILL_AFTER = "kill-after"  # the driver answered; kill -9 before the caller hears it
    TIMEOUT = "timeout"  # the caller's deadline expires (and is propagated) while the driver works
    DUPLICATE = "duplicate"  # the call reaches the driver twice at once; the caller sees one answer
    DROP = "drop"  # the driver answered; the answer never reaches the caller

    @property
    def kills(self) -> bool:
        return self in (FaultKind.KILL_BEFORE, FaultKind.KILL_AFTER)


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    method: str  # a CSI method's short name, e.g. CreateVolume
    occurrence: int = 1  # the n-th call of that method the caller makes (1: its first)

    def __str__(self) -> str:
        nth = "" if self.occurrence == 1 else f"#{self.occurrence}"
        return f"{self.kind} {self.method}{nth}"

    @property
    def spec(self) -> str:
        """The fault as `parse_fault` reads it (the stack's --driver-fault)."""
        nth = "" if self.occurrence == 1 else f"#{self.occurrence}"
        return f"{self.kind}:{self.method}{nth}"

    @property
    def slug(self) -> str:
        return f"{self.kind}-{self.method}-{self.occurrence}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": str(self.kind), "method": self.method, "occurrence": self.occurrence}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> Fault:
        return Fault(FaultKind(doc["kind"]), str(doc["method"]), int(doc.get("occurrence", 1)))


def parse_fault(text: str) -> Fault | None:
    """`kill-after:CreateVolume` (`#2` after the step: its second call); "" or `none`: no fault."""
    if text.strip() in ("", "none"):
        return None
    kind, sep, step = text.strip().partition(":")
    step, _, nth = step.partition("#")
    if not sep or step not in STEPS:
        raise ValueError(f"fault {text!r}: want KIND:STEP, STEP one of {', '.join(STEPS)}")
    return Fault(parse_kinds(kind)[0], step, int(nth or 1))


def parse_kinds(text: str) -> list[FaultKind]:
    """`kill-before,timeout` or `all`."""
    if text.strip() in ("", "all"):
        return list(FaultKind)
    out = []
    for word in text.split(","):
        try:
            out.append(FaultKind(word.strip()))
        except ValueError:
            known = ", ".join(k.value for k in FaultKind)
            raise ValueError(f"unknown fault {word.strip()!r} (known: {known}, or all)") from None
    return out


def sweep(kinds: Iterable[FaultKind], methods: Sequence[str]) -> list[Fault | None]:
    """One scenario with no fault (the baseline every other one is judged against), then each kind
    of fault on each method of the lifecycle, on its first call."""
    return [None, *(Fault(kind, method) for kind in kinds for method in methods)]
