"""Distributed provisioning (--node-deployment): one provisioner beside the driver on every node,
each provisioning only the claims whose selected node is its own, as kubernetes-csi's
external-provisioner does for node-local storage.

`NodeDeployment` is what such a provisioner knows about its node (from NODE_NAME and its driver's
NodeGetInfo); `OwnerDelays` is upstream's per-claim delay with jitter; `OwnerElection` is
upstream's becomeOwner: for an Immediate claim nobody has picked yet, wait that delay (giving up
early once another node took the claim), check that this node's pool can hold it, then write this
node as the claim's selected node with an update on the resourceVersion read. Only one such update
can succeed; the others get a conflict, and their next look sees the winner.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import grpc

from controller_runtime import storage
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.clock import Clock
from controller_runtime.csi_client import CSIConnection
from controller_runtime.kinds import CSINode, Node, PersistentVolumeClaim, StorageClass, as_obj, pvc_view
from controller_runtime.logs import get_logger
from controller_runtime.resources import object_key
from controller_runtime.storage import claim_request
from controller_runtime.store import Store
from controller_runtime.workqueue import ItemExponentialRateLimiter
from kubeloop_grpc.csi import csi_pb2

from .claims import update_claim_metadata
from .request import ProvisionError, Segment, Topology, split_parameters, volume_capabilities

log = get_logger("external-provisioner.node-deployment")


class Ownership(Enum):
    """How an attempt to own a claim ended."""

    OWNED = "owned"  # this node is the claim's selected node now
    TAKEN = "taken"  # another node was faster: its update brings the claim back, to be ignored
    NO_ROOM = "no-room"  # this node's pool cannot hold it now; another node may


class ClaimChanged(Exception):
    """An attempt to own a claim that could not finish (the claim went, was replaced, or the
    update failed otherwise): the sync's backoff tries again, as upstream's does."""


@dataclass(frozen=True)
class NodeDeployment:
    """This provisioner's node: its name (NODE_NAME), the driver's node id and topology segment
    (NodeGetInfo), and the flags of upstream's distributed provisioning."""

    node_name: str
    node_id: str
    segment: Segment = field(default_factory=dict)  # empty: the driver reports no topology
    immediate_binding: bool = True
    base_delay: float = 20.0
    max_delay: float = 60.0

    def local_objects(self, driver: str) -> tuple[CSINode, Node]:
        """The CSINode and Node the topology code sees, made from NodeGetInfo alone, as upstream
        does in node deployment: a provisioner on every node watching every Node object would
        load the API server for nothing, and only this node's segment is its to serve."""
        csinode: CSINode = {
            "metadata": {"name": self.node_name},
            "spec": {
                "drivers": [{"name": driver, "nodeID": self.node_id, "topologyKeys": sorted(self.segment)}]
            },
        }
        node: Node = {"metadata": {"name": self.node_name, "labels": dict(self.segment)}}
        return csinode, node


class OwnerDelays:
    """Upstream's per-claim delay before trying to own an Immediate claim: base * 2^attempts
    capped at max, minus a random share of base (so a first attempt waits between 0 and base,
    spreading the nodes' updates out). Forgotten once the claim is owned, by anyone, or deleted."""

    def __init__(self, base: float, maximum: float, rand: Callable[[], float] = random.random) -> None:
        self.base = base
        self._backoff: ItemExponentialRateLimiter[str] = ItemExponentialRateLimiter(base, maximum)
        self._rand = rand

    def when(self, uid: str) -> float:
        return max(0.0, self._backoff.when(uid) - self.base * self._rand())

    def attempts(self, uid: str) -> int:
        return self._backoff.num_requeues(uid)

    def forget(self, uid: str) -> None:
        self._backoff.forget(uid)


@dataclass(frozen=True)
class RequestShape:
    """What a CreateVolume for the claim would carry that GetCapacity also takes, so the capacity
    check asks the driver the question provisioning would."""

    default_fs: str
    multi_writer: bool


class OwnerElection:
    def __init__(
        self,
        node: NodeDeployment,
        client: ApiClient,
        csi: CSIConnection,
        claims: Store,
        clock: Clock,
        shape: RequestShape,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.node = node
        self.client = client
        self.csi = csi
        self.claims = claims
        self.clock = clock
        self.shape = shape
        self.delays = OwnerDelays(node.base_delay, node.max_delay, rand)
        # Upstream polls the cache at a hundredth of the base delay, never more often than 10 ms.
        self.poll = max(node.base_delay / 100, 0.01)

    def forget(self, uid: str) -> None:
        self.delays.forget(uid)

    def _taken(self, claim: PersistentVolumeClaim) -> tuple[bool, PersistentVolumeClaim]:
        """The claim as cached now, and whether another node owns it. Raises when it is gone or
        was replaced (another UID under the same name): the sync's backoff looks again."""
        md = claim["metadata"]
        current = pvc_view(self.claims.get(object_key(md["namespace"], md["name"])))
        if current is None:
            raise ClaimChanged(f"PVC {object_key(md['namespace'], md['name'])}: PVC not found")
        if current["metadata"]["uid"] != md["uid"]:
            raise ClaimChanged(f"PVC {object_key(md['namespace'], md['name'])}: PVC was replaced")
        selected = (current["metadata"].get("annotations") or {}).get(storage.ANN_SELECTED_NODE)
        return bool(selected) and selected != self.node.node_name, current

    async def _wait(self, claim: PersistentVolumeClaim) -> tuple[bool, PersistentVolumeClaim]:
        """Sleeps this attempt's delay, looking at the cache every poll interval so a claim
        another node took ends the wait early."""
        uid = claim["metadata"]["uid"]
        attempt = self.delays.attempts(uid)
        delay = self.delays.when(uid)
        md = claim["metadata"]
        log.debug(
            "will try to own claim",
            claim=object_key(md["namespace"], md["name"]),
            delay=delay,
            attempt=attempt,
        )
        deadline = self.clock.monotonic() + delay
        while True:
            left = deadline - self.clock.monotonic()
            if left <= 0:
                return self._taken(claim)
            await self.clock.sleep(min(self.poll, left))
            taken, current = self._taken(claim)
            if taken:
                return taken, current

    async def become_owner(
        self,
        claim: PersistentVolumeClaim,
        storage_class: StorageClass,
        pv_name: str,
        topology: Topology | None,
    ) -> Ownership:
        """Tries to make this node the claim's selected node. `topology` is what CreateVolume
        would ask for from this node (None: no requirement), `pv_name` its volume's name."""
        where = object_key(claim["metadata"]["namespace"], claim["metadata"]["name"])
        uid = claim["metadata"]["uid"]
        while True:
            taken, current = await self._wait(claim)
            if taken:
                # Someone else was faster; should the claim come back, start from the base delay.
                self.delays.forget(uid)
                log.debug("claim owned by another node", claim=where)
                return Ownership.TAKEN
            # As late as possible: GetCapacity costs the driver more than a look at the cache.
            if not await self._fits(current, storage_class, pv_name, topology):
                log.debug("not enough capacity on this node for the claim", claim=where)
                return Ownership.NO_ROOM
            md = current["metadata"]
            if (md.get("annotations") or {}).get(storage.ANN_SELECTED_NODE) == self.node.node_name:
                return Ownership.OWNED
            # An update of the claim read, as upstream's (a stale one is a conflict).
            try:
                await update_claim_metadata(
                    self.client, as_obj(current), annotations={storage.ANN_SELECTED_NODE: self.node.node_name}
                )
            except ApiError as exc:
                if not exc.conflict:
                    raise ClaimChanged(
                        f'PVC {where}: selecting node "{self.node.node_name}" for PVC failed: {exc}'
                    ) from exc
                # Lost the race, or the claim changed: wait longer, most likely to see the winner.
                log.debug("conflict selecting this node for the claim, trying again", claim=where)
                continue
            self.delays.forget(uid)
            log.info("selected this node for the claim", claim=where, node=self.node.node_name)
            return Ownership.OWNED

    async def _fits(
        self,
        claim: PersistentVolumeClaim,
        storage_class: StorageClass,
        pv_name: str,
        topology: Topology | None,
    ) -> bool:
        """Whether the driver says a segment of this node can hold the claim now. A check that
        cannot be made (bad parameters, a failed call) lets this node try to own the claim, as
        upstream: provisioning then fails with an event that tells the user why. A driver that
        refuses the class's parameters (INVALID_ARGUMENT) says this node cannot serve it at all."""
        size = claim_request(claim)
        if not size:
            return True
        try:
            params = split_parameters(
                storage_class.get("parameters") or {}, claim, pv_name, self.shape.default_fs
            )
            block = claim.get("spec", {}).get("volumeMode") == "Block"
            caps = volume_capabilities(
                claim.get("spec", {}).get("accessModes") or [],
                block,
                "" if block else params.fs_type,
                [] if block else list(storage_class.get("mountOptions") or []),
                self.shape.multi_writer,
            )
        except ProvisionError as exc:
            log.info("proceeding with becoming owner although the capacity check failed", error=str(exc))
            return True
        segments: list[Segment | None] = (
            list(topology.requisite) if topology and topology.requisite else [None]
        )
        for segment in segments:
            req = csi_pb2.GetCapacityRequest(volume_capabilities=caps, parameters=params.driver)
            if segment is not None:
                req.accessible_topology.CopyFrom(csi_pb2.Topology(segments=segment))
            try:
                rsp = await self.csi.controller.GetCapacity(req, timeout=self.csi.timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    # The driver refuses the class's parameters here (a pool kind this node lacks):
                    # owning the claim would only fail its CreateVolume; another node may serve it.
                    log.info(
                        "this node cannot serve the claim's class", error=f"GetCapacity: {exc.details()}"
                    )
                    return False
                log.info(
                    "proceeding with becoming owner although the capacity check failed",
                    error=f"GetCapacity: {exc.details()}",
                )
                return True
            if size <= rsp.available_capacity:
                return True
        return False
