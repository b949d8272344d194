"""What a failed CSI call leaves behind, decided once where the call returns.

When a call to the driver fails, a sidecar must know whether the driver may still be doing what it
was asked (then only the same call may follow, or the inverse one: the volume may be half made) or
has certainly stopped; and, of the calls that stopped, whether another node may succeed (the claim
goes back to the scheduler) or the same request never can (retried slowly; the user must change
it). Each Go sidecar answers this in one place: external-provisioner's checkError, giving
sig-storage-lib-external-provisioner's ProvisioningState; external-attacher's isFinalError;
external-resizer's IsFinalError and IsInfeasibleError. `classify` is that answer for every call
kubeloop's sidecars make: a pure function of the gRPC code, the call (`Rpc`: the codes in which the
Go sidecars differ per call) and what only the caller knows (`may_reschedule`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc
from grpc import StatusCode

from .csi_common import IN_PROGRESS
from .secrets import SecretNotSendable

# Codes after which a call may still be running in the driver: gRPC's cancelled, timed out and
# transport-broken calls, and CSI's "an operation is pending for this volume".
IN_PROGRESS_CODES = frozenset(StatusCode[name] for name in IN_PROGRESS)


class OperationState(enum.Enum):
    """What a failed call left behind (ProvisioningState's values, and the two final kinds the
    provisioner's and the resizer's slow retries act on)."""

    # The operation certainly stopped: the next attempt may start afresh.
    FINISHED = "Finished"
    # The operation may still be running in the driver: repeat the same call (or clean up with the
    # inverse one) before anything else, even if the object that asked for it is gone.
    IN_BACKGROUND = "Background"
    # Stopped, and another node may have what this one lacks: give the claim back to the scheduler.
    RESCHEDULE = "Reschedule"
    # Stopped, and the same request can never succeed: retry it only slowly; the user must change it.
    INFEASIBLE = "Infeasible"

    @property
    def final(self) -> bool:
        return self is not OperationState.IN_BACKGROUND


@dataclass(frozen=True)
class Rpc:
    """How the failures of one CSI call read, where the Go sidecars' tables differ."""

    # Codes after which this call may still be running.
    in_progress: frozenset[StatusCode] = IN_PROGRESS_CODES
    # Final codes that say the same request can never succeed.
    infeasible: frozenset[StatusCode] = frozenset()
    # Final codes that another node may not give: rescheduled when the caller may reschedule.
    node_bound: frozenset[StatusCode] = frozenset()


# CreateVolume, as checkError and the library's isInfeasibleError read it. RESOURCE_EXHAUSTED is
# "unable to provision in accessible_topology" (CSI spec): nothing is pending, another node may
# have room. ALREADY_EXISTS, which checkError counts as finished, means a volume of this name
# exists (made for an earlier, different request): kubeloop keeps the claim's intent for it, as
# for a call that may still be running, so a deleted claim's clean-up still looks for that volume.
CREATE_VOLUME = Rpc(
    in_progress=IN_PROGRESS_CODES | {StatusCode.ALREADY_EXISTS},
    infeasible=frozenset({StatusCode.INVALID_ARGUMENT}),
    node_bound=frozenset({StatusCode.RESOURCE_EXHAUSTED}),
)
DELETE_VOLUME = Rpc()
# ControllerPublishVolume and ControllerUnpublishVolume, as external-attacher's isFinalError reads
# them: RESOURCE_EXHAUSTED is a busy server whose earlier call may still be running.
PUBLISH_VOLUME = Rpc(in_progress=IN_PROGRESS_CODES | {StatusCode.RESOURCE_EXHAUSTED})
# ControllerExpandVolume (and NodeExpandVolume, which the node side reads alike), as
# external-resizer's IsFinalError and IsInfeasibleError read it: a size out of range, or a volume
# the driver does not know, cannot be had by asking again.
EXPAND_VOLUME = Rpc(
    in_progress=IN_PROGRESS_CODES | {StatusCode.RESOURCE_EXHAUSTED},
    infeasible=frozenset({StatusCode.INVALID_ARGUMENT, StatusCode.OUT_OF_RANGE, StatusCode.NOT_FOUND}),
)

# ControllerModifyVolume, as external-resizer's modify controller reads it: IsFinalError's table,
# and of the final codes only INVALID_ARGUMENT (parameters the volume cannot take) is Infeasible.
MODIFY_VOLUME = Rpc(
    in_progress=IN_PROGRESS_CODES | {StatusCode.RESOURCE_EXHAUSTED},
    infeasible=frozenset({StatusCode.INVALID_ARGUMENT}),
)


def classify(rpc: Rpc, code: StatusCode | None, *, may_reschedule: bool = False) -> OperationState:
    """The state a call of `rpc` that failed with `code` leaves. `code` None is a failure without
    a gRPC status, which may have come after the request left: as upstream, it may be running.
    `may_reschedule`: the request named a node's topology (a driver with topology, a claim with a
    selected node), so another node may succeed where this one could not."""
    if code is None or code in rpc.in_progress:
        return OperationState.IN_BACKGROUND
    if code in rpc.infeasible:
        return OperationState.INFEASIBLE
    if may_reschedule and code in rpc.node_bound:
        return OperationState.RESCHEDULE
    return OperationState.FINISHED


def status_code(exc: BaseException) -> StatusCode | None:
    """The gRPC code a failed call ended with, None for a failure outside gRPC. A Secret that
    cannot be marshalled is the Go client's failure with Internal (secrets.NOT_UTF8): final, the
    driver was never asked."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code: StatusCode = exc.code()
        return code
    if isinstance(exc, SecretNotSendable):
        return StatusCode.INTERNAL
    return None
