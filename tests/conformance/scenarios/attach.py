"""Attach and detach with pods: kubernetes pkg/controller/volume/attachdetach (reconciler_test.go,
attach_detach_controller_test.go, the desired-state populator) and kubernetes-csi external-attacher
(csi_handler_test.go). Our node agent mounts the volumes of scheduled pods on both sides.

Every volume here is a real driver volume, pre-bound both ways to its claim, so no scenario waits
for the binder's resync before its pod can start."""

from __future__ import annotations

from ..build import (
    ROX,
    RWOP,
    RWX,
    attached,
    bound,
    delete,
    event,
    exists,
    gone,
    patch,
    phase,
    pod,
    pv,
    pvc,
    running,
    sleep,
    wait,
)
from ..model import DriverVolume, Kill, Observe, Restart, Scenario, Step

RT = "attachdetach reconciler_test.go"
CH = "external-attacher csi_handler_test.go"
OUT_OF_SERVICE = {"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute"}
POD_WAIT = 90.0


def volume(
    name: str = "claim1", *, modes: tuple[str, ...] = ("ReadWriteOnce",), block: bool = False
) -> tuple[Step, ...]:
    """A driver volume, its PV and claim pre-bound to each other, bound."""
    return (
        DriverVolume(f"d-{name}", block=block),
        pv(f"pv-{name}", modes=modes, claim=name, vol=f"d-{name}", block=block),
        pvc(name, modes=modes, volume=f"pv-{name}", block=block),
        wait(bound(name)),
    )


def attached_running(pod_name: str, pv_name: str, node: str) -> Step:
    return wait(running(pod_name), attached(pv_name, node), timeout=POD_WAIT)


def in_use(node: str) -> tuple[Step, ...]:
    """claim1's volume attached to `node` and mounted for pod p1 there."""
    return (*volume(), pod("p1", "claim1", node=node), attached_running("p1", "pv-claim1", node))


def orphaned_mount(node: str) -> tuple[Step, ...]:
    """The volume still mounted on `node` (its node agent is down) after p1 was force-deleted."""
    return (
        *in_use(node),
        Kill(f"node-agent-{node}"),
        delete("pod", "p1", grace_seconds=0),
        wait(gone("pod", "p1")),
    )


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "attach-pod-on-node",
        f"{RT}: Single pod, single volume: attach",
        (*volume(), pod("p1", "claim1", node="node-a"), attached_running("p1", "pv-claim1", "node-a")),
        subset=True,
    ),
    Scenario(
        "detach-on-pod-delete",
        f"{RT}: attach then detach when the pod is gone",
        (
            *in_use("node-a"),
            delete("pod", "p1"),
            wait(gone("va", "pv-claim1@node-a"), gone("pod", "p1"), timeout=POD_WAIT),
        ),
        subset=True,
    ),
    Scenario(
        "attach-scheduled-pod",
        f"{RT}: a pod placed by the scheduler",
        (*volume(), pod("p1", "claim1", on="node-b"), attached_running("p1", "pv-claim1", "node-b")),
    ),
    Scenario(
        "multi-attach-rwo-two-nodes",
        f"{RT}: Multi-Attach error: an RWO volume used by a pod on another node",
        (
            *in_use("node-a"),
            pod("p2", "claim1", node="node-b"),
            wait(event("pod", "p2", "FailedAttachVolume"), timeout=30),
            sleep(3),
        ),
        subset=True,
    ),
    Scenario(
        "multi-attach-moves-after-first-pod-deleted",
        f"{RT}: the second node gets the volume once the first pod is gone",
        (
            *in_use("node-a"),
            pod("p2", "claim1", node="node-b"),
            wait(event("pod", "p2", "FailedAttachVolume"), timeout=30),
            delete("pod", "p1"),
            attached_running("p2", "pv-claim1", "node-b"),
        ),
    ),
    Scenario(
        "multi-attach-rox-two-nodes",
        f"{RT}: ReadOnlyMany volumes attach to several nodes",
        (
            *volume(modes=ROX),
            pod("p1", "claim1", node="node-a", read_only=True),
            pod("p2", "claim1", node="node-b", read_only=True),
            wait(attached("pv-claim1", "node-a"), attached("pv-claim1", "node-b"), timeout=POD_WAIT),
            sleep(3),
        ),
    ),
    Scenario(
        "multi-attach-rwx-two-nodes",
        f"{RT}+{CH}: ReadWriteMany: the controller allows it, the driver decides",
        (
            *volume(modes=RWX),
            pod("p1", "claim1", node="node-a"),
            pod("p2", "claim1", node="node-b"),
            wait(exists("va", "pv-claim1@node-a"), exists("va", "pv-claim1@node-b"), timeout=30),
            sleep(8),
        ),
    ),
    Scenario(
        "rwop-second-pod-same-node",
        "scheduler + attach: a ReadWriteOncePod claim used by a second pod",
        (
            *volume(modes=RWOP),
            pod("p1", "claim1", on="node-a"),
            attached_running("p1", "pv-claim1", "node-a"),
            pod("p2", "claim1", on="node-a"),
            sleep(5),
        ),
    ),
    Scenario(
        "attach-block-volume",
        f"{CH}: a raw block volume",
        (
            *volume(block=True),
            pod("p1", "claim1", node="node-a", block=True),
            attached_running("p1", "pv-claim1", "node-a"),
        ),
    ),
    Scenario(
        "attach-two-volumes-one-pod",
        f"{RT}: one pod, two volumes",
        (
            *volume("c1"),
            *volume("c2"),
            pod("p1", "c1", "c2", node="node-b"),
            wait(running("p1"), attached("pv-c1", "node-b"), attached("pv-c2", "node-b"), timeout=POD_WAIT),
        ),
    ),
    Scenario(
        "attach-shared-by-two-pods-same-node",
        f"{RT}: two pods on one node share one attachment; it stays until both are gone",
        (
            *volume(),
            pod("p1", "claim1", node="node-a"),
            pod("p2", "claim1", node="node-a"),
            wait(running("p1"), running("p2"), attached("pv-claim1", "node-a"), timeout=POD_WAIT),
            delete("pod", "p1"),
            wait(gone("pod", "p1"), timeout=POD_WAIT),
            sleep(3),
            Observe("one-pod-left"),
            delete("pod", "p2"),
            wait(gone("va", "pv-claim1@node-a"), timeout=POD_WAIT),
        ),
    ),
    Scenario(
        "attach-pod-with-unbound-claim",
        "desired-state populator: a pod whose claim binds later gets its volume attached",
        (
            pvc("claim1", volume="pv-claim1"),
            pod("p1", "claim1", node="node-a"),
            sleep(3),
            DriverVolume("d-claim1"),
            pv("pv-claim1", claim="claim1", vol="d-claim1"),
            wait(bound("claim1")),
            attached_running("p1", "pv-claim1", "node-a"),
        ),
    ),
    Scenario(
        "attach-pod-claim-missing",
        f"{RT}: a pod whose claim does not exist",
        (pod("p1", "nosuch", node="node-a"), sleep(5)),
    ),
    Scenario(
        "attach-unknown-volume-fails",
        f"{CH}: ControllerPublishVolume of a volume the driver does not have",
        (
            pv("pv-claim1", claim="claim1"),
            pvc("claim1", volume="pv-claim1"),
            wait(bound("claim1")),
            pod("p1", "claim1", node="node-a"),
            wait(event("pod", "p1", "FailedAttachVolume"), timeout=45),
            sleep(3),
        ),
    ),
    Scenario(
        "detach-force-deleted-pod",
        f"{RT}: a pod deleted with grace period 0 still gets its volume unmounted and detached",
        (
            *in_use("node-b"),
            delete("pod", "p1", grace_seconds=0),
            wait(gone("va", "pv-claim1@node-b"), timeout=POD_WAIT),
        ),
    ),
    Scenario(
        "detach-terminated-pod",
        f"{RT}: a pod that has terminated (phase Succeeded) no longer needs its volume",
        (
            *in_use("node-a"),
            patch("pod", "p1", {"status": {"phase": "Succeeded"}}, subresource="status"),
            sleep(10),
        ),
    ),
    Scenario(
        "attach-attacher-down",
        f"{CH}: the VolumeAttachment waits for the attacher; attached once it is back",
        (
            *volume(),
            Kill("attacher"),
            pod("p1", "claim1", node="node-a"),
            wait(exists("va", "pv-claim1@node-a"), timeout=30),
            sleep(3),
            Observe("attacher-down"),
            Restart("attacher"),
            attached_running("p1", "pv-claim1", "node-a"),
        ),
        exclusive=True,
    ),
    Scenario(
        "attach-detach-controller-restart",
        "attach_detach_controller.go populateActualStateOfWorld: a restart keeps attached volumes",
        (
            *in_use("node-a"),
            Kill("attach-detach"),
            Restart("attach-detach"),
            sleep(10),
            Observe("after-restart"),
            delete("pod", "p1"),
            wait(gone("va", "pv-claim1@node-a"), timeout=POD_WAIT),
        ),
        exclusive=True,
    ),
    Scenario(
        "detach-waits-while-mounted",
        f"{RT}: a volume still in use on the node is not detached when its pod is force-deleted",
        (
            *orphaned_mount("node-b"),
            sleep(10),
            Observe("node-agent-down"),
            Restart("node-agent-node-b"),
            wait(gone("va", "pv-claim1@node-b"), timeout=POD_WAIT),
        ),
        exclusive=True,
    ),
    Scenario(
        "detach-out-of-service-taint",
        f"{RT}: the node.kubernetes.io/out-of-service taint force-detaches a volume still in use",
        (
            *orphaned_mount("node-b"),
            sleep(5),
            patch("node", "node-b", {"spec": {"taints": [OUT_OF_SERVICE]}}),
            wait(gone("va", "pv-claim1@node-b"), timeout=30),
            Observe("tainted"),
            patch("node", "node-b", {"spec": {"taints": None}}),
            Restart("node-agent-node-b"),
            sleep(5),
        ),
        exclusive=True,
    ),
    Scenario(
        "multi-attach-exclusive-message",
        f"{RT}: Multi-Attach when no pod uses the volume on the other node any more",
        (
            *orphaned_mount("node-a"),
            pod("p2", "claim1", node="node-b"),
            wait(event("pod", "p2", "FailedAttachVolume"), timeout=30),
            sleep(2),
            Observe("blocked"),
            Restart("node-agent-node-a"),
            attached_running("p2", "pv-claim1", "node-b"),
        ),
        exclusive=True,
    ),
    Scenario(
        "node-deleted-with-attached-volume",
        "attach_detach_controller.go nodeDelete: a Node deleted while a volume is attached to it",
        (
            *in_use("node-b"),
            delete("node", "node-b"),
            sleep(10),
            Observe("node-deleted"),
            delete("pod", "p1", grace_seconds=0),
            Kill("node-agent-node-b"),
            Restart("node-agent-node-b"),
            wait(exists("node", "node-b"), timeout=30),
            wait(gone("va", "pv-claim1@node-b"), timeout=POD_WAIT),
        ),
        exclusive=True,
    ),
    Scenario(
        "attach-volume-of-released-claim-pod",
        f"{RT}: a pod whose claim is deleted while it runs keeps its volume until it is gone",
        (
            *in_use("node-a"),
            delete("pvc", "claim1"),
            sleep(4),
            Observe("claim-deleting"),
            delete("pod", "p1"),
            wait(gone("va", "pv-claim1@node-a"), gone("pvc", "claim1"), timeout=POD_WAIT),
            wait(phase("pv", "pv-claim1", "Released")),
        ),
    ),
)
