"""The external-resizer's controller: claims whose PV belongs to our driver, one idempotent sync
each, at most one in flight per claim (the workqueue's processing set), per-claim exponential
backoff between failed attempts.

One attempt, in the order kubernetes-csi external-resizer writes:
  1. PVC status: Resizing, allocatedResources = the size worked towards, ControllerResizeInProgress;
  2. event Resizing, then ControllerExpandVolume;
  3. PV spec.capacity, and when the node must still grow the filesystem, the annotation
     volume.alpha.kubernetes.io/pre-resize-capacity = the claim's capacity before (unless already
     there: the first size a pending resize started from stays); a later sync that finds the
     claim's capacity caught up with the PV's removes it;
  4. PVC status: FileSystemResizePending + NodeResizePending (the node finishes), or capacity set
     and the resize status cleared when the driver needs no node step.
A failed ControllerExpandVolume is written to the claim (ControllerResizeError; an infeasible size
also ControllerResizeInfeasible) so the user can lower the request, and retried with backoff.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

import grpc

from controller_runtime import resize_status as rs
from controller_runtime.client import ApiError
from controller_runtime.clock import now_rfc3339
from controller_runtime.controller import ControllerContext, run_workers
from controller_runtime.csi_client import CSIConnection, SidecarController, SidecarOptions, error_text
from controller_runtime.csi_errors import EXPAND_VOLUME, OperationState, classify, status_code
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.kinds import (
    Node,
    PersistentVolume,
    PersistentVolumeClaim,
    as_obj,
    node_view,
    pod_view,
    pv_view,
    pvc_view,
)
from controller_runtime.logs import get_logger
from controller_runtime.mutation_cache import MutationCache
from controller_runtime.quantity import format_quantity, parse_quantity
from controller_runtime.resources import (
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    Obj,
    key_of,
    typed,
)
from controller_runtime.secrets import read_csi_secrets
from controller_runtime.storage import claim_request, storage_of
from controller_runtime.volumes import csi_volume, pod_claims, pv_capability
from controller_runtime.workqueue import ItemExponentialRateLimiter, WorkQueue
from kubeloop_grpc.csi import csi_pb2

from .decide import (
    EVENT_FS_RESIZE_REQUIRED,
    EVENT_RESIZE_FAILED,
    EVENT_RESIZE_SUCCESSFUL,
    EVENT_RESIZING,
    MSG_FS_RESIZE_REQUIRED,
    MSG_RESIZE_SUCCEEDED,
    Attempt,
    Sizes,
    served_by_node,
    target,
)
from .modify import Modifier

log = get_logger("external-resizer")

ControllerRPC = csi_pb2.ControllerServiceCapability.RPC
NodeRPC = csi_pb2.NodeServiceCapability.RPC
CLAIMS_BY_POD = "claims"


@dataclass(frozen=True)
class Options(SidecarOptions):
    # `timeout` (SidecarOptions) is ControllerExpandVolume's (--resize-timeout); this is
    # ControllerModifyVolume's (--modify-timeout). An explicit --timeout sets both.
    modify_timeout: float = 10.0
    handle_volume_in_use_error: bool = True
    extra_modify_metadata: bool = False  # --extra-modify-metadata (the modify controller)
    # --node-deployment: this resizer's node (NODE_NAME); it serves only the PVs whose node
    # affinity that Node's labels satisfy (a kubeloop extension: upstream has no node deployment).
    node_name: str | None = None


class VolumeNotCached(Exception):
    """In node deployment, a bound claim whose PV is not in the cache yet: it cannot be told
    whether the volume is this node's, so the claim is retried with backoff and no event (every
    other node's resizer would warn about the same claim)."""


class ResizeError(Exception):
    """An attempt that failed; its text is the VolumeResizeFailed event's message."""


class WriteFailed(Exception):
    """A write to the claim or the PV that failed outside an expansion's steps that report: retried
    with backoff, without an event (upstream returns it without one)."""


class VolumeCapabilityError(Exception):
    """The PV's access modes have no CSI capability to send (controller_runtime.volumes)."""


def lease_name(driver: str) -> str:
    """`external-resizer-<driver>`, with what a Lease name cannot hold replaced as the Go sidecar does."""
    name = "external-resizer-" + re.sub(r"[^a-zA-Z0-9-]", "-", driver)
    return name + "X" if name.endswith("-") else name


def _annotations(pv: PersistentVolume) -> dict[str, str]:
    return pv["metadata"].get("annotations") or {}


def sizes(claim: PersistentVolumeClaim, pv: PersistentVolume) -> Sizes:
    status = claim.get("status") or {}
    allocated = (status.get("allocatedResources") or {}).get("storage")
    return Sizes(
        request=claim_request(claim),
        capacity=storage_of(status.get("capacity")),
        pv=storage_of((pv.get("spec") or {}).get("capacity")),
        allocated=None if allocated is None else parse_quantity(allocated),
        resize_status=rs.resize_status(claim),
        fs_resize_pending=rs.has_condition(claim, rs.FS_RESIZE_PENDING),
    )


class Resizer(SidecarController):
    def __init__(
        self, context: ControllerContext, csi: CSIConnection, options: Options | None = None
    ) -> None:
        super().__init__(context, csi)
        self.options = options or Options()
        # A driver without controller expansion but with node expansion gets the "trivial"
        # resizer: no RPC, the PV takes the requested size and the node does the work.
        self.trivial = not csi.has_controller_capability(ControllerRPC.EXPAND_VOLUME)
        # The access mode ControllerExpandVolume names: RWO is SINGLE_NODE_MULTI_WRITER for a
        # driver that has it, as the volume was created and published with.
        self.single_node_multi_writer = csi.has_controller_capability(ControllerRPC.SINGLE_NODE_MULTI_WRITER)
        self.queue: WorkQueue[str] = WorkQueue(
            f"{self.driver}-pvc",
            ItemExponentialRateLimiter(self.options.retry_start, self.options.retry_max),
            clock=self.clock,
        )
        self.claims = self.factory.informer(PERSISTENT_VOLUME_CLAIMS)
        self.volumes = self.factory.informer(PERSISTENT_VOLUMES)
        # The caches as this resizer's own patches left them: the next step of an attempt reads
        # what the last one wrote, before the watch delivers it.
        self.claim_view = MutationCache(self.claims.store, clock=self.clock)
        self.volume_view = MutationCache(self.volumes.store, clock=self.clock)
        self.claims.add_handler(
            EventHandler(lambda c: self.queue.add(key_of(c)), self._claim_updated, self._claim_deleted)
        )
        self.volumes.add_handler(EventHandler(None, None, self.volume_view.deleted))
        # In node deployment, this node's Node object only (not every Node: one resizer per node
        # watching all of them would load the API server for nothing). Its labels decide which
        # volumes are served; they may come after the resizer starts (kubelet adds the driver's
        # topology label when the plugin registers), so a change of labels looks at every claim again.
        self.node: SharedInformer | None = None
        node = self.options.node_name
        if node is not None:
            self.node = self.factory.informer(NODES, field_selector=f"metadata.name={node}")
            self.node.add_handler(EventHandler(self._node_changed, self._node_updated, self._node_changed))
        self.pods = None
        if self.options.handle_volume_in_use_error:
            # A node-local volume is used only by pods on its node: a node's resizer needs no
            # other pods (every node caching every pod of the cluster would cost N times the memory).
            field_selector = "" if node is None else f"spec.nodeName={node}"
            self.pods = self.factory.informer(PODS, field_selector=field_selector)
            self.pods.add_index(
                CLAIMS_BY_POD,
                lambda p: [f"{p['metadata']['namespace']}/{c}" for _v, c, _ro in pod_claims(pod_view(p))],
            )
        # In memory only, as upstream: which claims' last attempt ended in a final error, when an
        # infeasible size was first seen, and which claims' volumes the driver said are in use.
        self.final_errors: set[str] = set()
        self.infeasible_since: dict[str, float] = {}
        self.in_use: set[str] = set()

    # -- handlers: enqueue only -------------------------------------------------------------------

    def _claim_updated(self, old_obj: Obj, new_obj: Obj) -> None:
        old, new = pvc_view(old_obj), pvc_view(new_obj)
        o_status, n_status = old.get("status") or {}, new.get("status") or {}
        annotations = (old["metadata"].get("annotations") or {}, new["metadata"].get("annotations") or {})
        if (
            claim_request(old) != claim_request(new)
            or annotations[0].get(rs.RESIZER_ANNOTATION) != annotations[1].get(rs.RESIZER_ANNOTATION)
            or old["metadata"].get("resourceVersion") == new["metadata"].get("resourceVersion")
            or storage_of(n_status.get("capacity")) > storage_of(o_status.get("capacity"))
            or rs.resize_status(old) != rs.resize_status(new)
        ):
            self.queue.add(key_of(new))

    def _node_updated(self, old: Obj, new: Obj) -> None:
        if node_view(old)["metadata"].get("labels") != node_view(new)["metadata"].get("labels"):
            self._node_changed(new)

    def _node_changed(self, _node: Obj) -> None:
        for claim in self.claims.store.values():
            self.queue.add(key_of(claim))

    def _claim_deleted(self, claim: Obj) -> None:
        self.claim_view.deleted(claim)
        self.queue.forget(key_of(claim))

    async def run(self) -> None:
        await self.start_informers()
        if self.node is not None and self._own_node() is None:
            log.warning(
                "node deployment: no Node of this name yet; no volume is served until it appears",
                node=self.options.node_name,
            )
        log.info(
            "caches synced, starting workers",
            driver=self.driver,
            workers=self.options.workers,
            trivial=self.trivial,
            node=self.options.node_name,
        )
        await run_workers(self.queue, self.sync, self.options.workers)

    def _own_node(self) -> Node | None:
        assert self.node is not None and self.options.node_name is not None
        return node_view(self.node.store.get(self.options.node_name))

    def serves(self, pv: PersistentVolume) -> bool:
        """Whether this resizer acts on the PV's claim: every PV without --node-deployment, and
        only this node's with it."""
        return self.node is None or served_by_node(pv, self._own_node())

    # -- the sync ---------------------------------------------------------------------------------

    def _ours(self, pv: PersistentVolume) -> bool:
        """A claim is ours by its PV's driver only. Upstream also honours the claim's
        storage-resizer annotation, but only for a driver that in-tree volumes migrate to, which
        no kubeloop driver is; and the annotation is the claim author's to write: naming this
        driver on a claim of another driver's volume, or of a non-CSI one, made this resizer
        expand it (or, without EXPAND_VOLUME, write the PV's capacity without expanding anything)."""
        vol = csi_volume(pv)
        return vol is not None and vol.driver == self.driver

    async def sync(self, key: str) -> float | None:
        claim = pvc_view(self.claim_view.get(key))
        if claim is None:
            return None
        pv_name = (claim.get("spec") or {}).get("volumeName")
        if not pv_name:
            return None
        pv = pv_view(self.volume_view.get(pv_name))
        if pv is None:
            if self.node is not None:
                raise VolumeNotCached(f'PV "{pv_name}" bound to pvc "{key}" not found')
            raise ResizeError(f'PV "{pv_name}" bound to pvc "{key}" not found')
        if not self.serves(pv):
            return None  # another node's volume (or one no node deployment serves): not a word
        s = sizes(claim, pv)
        if s.capacity >= s.pv and rs.PRE_RESIZE_CAPACITY in _annotations(pv):
            # The node finished: the PV no longer needs to remember the size before the resize.
            # Upstream does this for any claim's PV, before it looks at phase or driver.
            try:
                await self._patch_pv(pv, {"metadata": {"annotations": {rs.PRE_RESIZE_CAPACITY: None}}})
            except ApiError as e:
                raise WriteFailed(
                    f'failed removing annotation {rs.PRE_RESIZE_CAPACITY} from pv "{pv_name}": '
                    f"update capacity of PV {pv_name} failed: {e}"
                ) from e
        if (claim.get("status") or {}).get("phase") != "Bound" or s.request <= s.capacity:
            return None
        ref = (pv.get("spec") or {}).get("claimRef") or {}
        md = claim["metadata"]
        if not self._ours(pv) or ref.get("namespace") != md["namespace"] or ref.get("uid") != md["uid"]:
            return None
        if s.resize_status == rs.CONTROLLER_INFEASIBLE:
            self.infeasible_since.setdefault(key, self.clock.monotonic())
        attempt = target(s, key in self.final_errors, self.trivial)
        if attempt is None:
            return None
        if not attempt.update_status and key in self.infeasible_since:
            # The same infeasible size is tried again only once per --retry-interval-max.
            remaining = self.infeasible_since[key] + self.options.retry_max - self.clock.monotonic()
            if remaining > 0:
                log.debug(
                    f"skipping volume expansion for pvc {key}, because expansion previously failed "
                    "with infeasible error",
                    retry_in=round(remaining, 1),
                )
                return remaining
            self.infeasible_since.pop(key)
        try:
            await self._attempt(key, claim, pv, attempt)
        except ResizeError as e:
            self.recorder.warning(typed(as_obj(claim), PERSISTENT_VOLUME_CLAIMS), EVENT_RESIZE_FAILED, str(e))
            raise
        return None

    async def _attempt(
        self, key: str, claim: PersistentVolumeClaim, pv: PersistentVolume, attempt: Attempt
    ) -> None:
        status = claim.get("status") or {}
        # Upstream records the claim's capacity as the sync found it ("0" without one).
        old_capacity = str((status.get("capacity") or {}).get("storage") or "0")
        try:
            claim = await self._patch_claim(
                claim,
                rs.in_progress(status, format_quantity(attempt.size), attempt.update_status, now_rfc3339()),
                annotations={rs.NODE_EXPANSION_NOT_REQUIRED: None},
            )
        except ApiError as e:
            raise WriteFailed(f'marking pvc "{key}" as resizing failed: {e}') from e
        pv_name = pv["metadata"]["name"]
        if self._in_use(claim):
            raise ResizeError(
                f"Unable to expand {key} because CSI driver {self.driver} only supports offline expansion "
                "and volume is currently in-use"
            )
        self.recorder.normal(
            typed(as_obj(claim), PERSISTENT_VOLUME_CLAIMS),
            EVENT_RESIZING,
            f"External resizer is resizing volume {pv_name}",
        )
        new_size, node_expansion = await self._expand(key, claim, pv, attempt.size)
        pv_patch: Obj = {"spec": {"capacity": {"storage": format_quantity(new_size)}}}
        if node_expansion and rs.PRE_RESIZE_CAPACITY not in _annotations(pv):
            pv_patch["metadata"] = {"annotations": {rs.PRE_RESIZE_CAPACITY: old_capacity}}
        try:
            await self._patch_pv(pv, pv_patch)
        except ApiError as e:
            raise ResizeError(
                f'error updating pv "{pv_name}" by resizer: updating capacity of PV "{pv_name}" '
                f"to {format_quantity(new_size)} failed: update capacity of PV {pv_name} failed: {e}"
            ) from e
        status = claim.get("status") or {}
        if node_expansion:
            try:
                claim = await self._patch_claim(
                    claim,
                    rs.node_expansion_pending(status, now_rfc3339()),
                    annotations={rs.NODE_EXPANSION_NOT_REQUIRED: None},
                )
            except ApiError as e:
                raise ResizeError(f'mark PVC "{key}" as node expansion required failed: {e}') from e
            self.recorder.normal(
                typed(as_obj(claim), PERSISTENT_VOLUME_CLAIMS),
                EVENT_FS_RESIZE_REQUIRED,
                MSG_FS_RESIZE_REQUIRED,
            )
        else:
            try:
                claim = await self._patch_claim(
                    claim,
                    rs.finished(status, format_quantity(new_size)),
                    annotations={rs.NODE_EXPANSION_NOT_REQUIRED: "true"},
                )
            except ApiError as e:
                raise ResizeError(f'mark PVC "{key}" as resize finished failed: {e}') from e
            self.recorder.normal(
                typed(as_obj(claim), PERSISTENT_VOLUME_CLAIMS), EVENT_RESIZE_SUCCESSFUL, MSG_RESIZE_SUCCEEDED
            )
        log.info("resized volume", pvc=key, pv=pv_name, size=new_size, node_expansion=node_expansion)

    async def _expand(
        self, key: str, claim: PersistentVolumeClaim, pv: PersistentVolume, size: int
    ) -> tuple[int, bool]:
        """ControllerExpandVolume; a failure is recorded on the claim before it is raised."""
        if self.trivial:
            return size, True
        vol = csi_volume(pv)
        assert vol is not None  # _ours checked it
        self.in_use.discard(key)
        try:
            # Upstream's order: the controller-expand Secret, the capability, the call. A failure of
            # either of the first two is no gRPC status: not final (nothing was asked of the driver).
            secrets = await self._secrets(pv)
            try:
                capability = pv_capability(vol, self.single_node_multi_writer)
            except ValueError as exc:
                name = pv["metadata"]["name"]
                raise VolumeCapabilityError(
                    f"failed to get capabilities of volume {name} with {exc}"
                ) from exc
            req = csi_pb2.ControllerExpandVolumeRequest(
                volume_id=vol.handle,
                capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                secrets=secrets,
                volume_capability=capability,
            )
            rsp = await self.csi.controller.ControllerExpandVolume(req, timeout=self.options.timeout)
        except Exception as exc:
            code = status_code(exc)
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                self.in_use.add(key)  # in use: not tried again while a running pod uses it
            state = classify(EXPAND_VOLUME, code)
            raise await self._expansion_failed(key, claim, pv, error_text(exc), state) from exc
        self.final_errors.discard(key)
        self.infeasible_since.pop(key, None)
        return int(rsp.capacity_bytes) or size, bool(rsp.node_expansion_required)

    async def _expansion_failed(
        self, key: str, claim: PersistentVolumeClaim, pv: PersistentVolume, text: str, state: OperationState
    ) -> ResizeError:
        """What a failed expansion leaves: a final one is written to the claim (and an infeasible
        size keeps its slow retries); after one that may still be running the next attempt repeats
        the same size. Returns the error the attempt fails with."""
        name = pv["metadata"]["name"]
        failed = ResizeError(f'resize volume "{name}" by resizer "{self.driver}" failed: {text}')
        if not state.final:
            self.final_errors.discard(key)
            self.infeasible_since.pop(key, None)
            return failed
        self.final_errors.add(key)
        infeasible = state is OperationState.INFEASIBLE
        if not infeasible:
            self.infeasible_since.pop(key, None)
        marked = rs.controller_failed(
            claim.get("status") or {}, f"failed to expand pvc with {text}", infeasible, now_rfc3339()
        )
        try:
            await self._patch_claim(claim, marked, resource_version=False)
        except ApiError as e:
            return ResizeError(
                f"resizing failed in controller with {text} but failed to update PVC {key} with: {e}"
            )
        return failed

    async def _secrets(self, pv: PersistentVolume) -> dict[str, str]:
        """The PV's controllerExpandSecretRef, read for ControllerExpandVolume as upstream reads it
        (a Secret that cannot be read fails the attempt: the driver may need it)."""
        ref = ((pv.get("spec") or {}).get("csi") or {}).get("controllerExpandSecretRef")
        if not ref:
            return {}
        return await read_csi_secrets(
            self.client, str(ref.get("name") or ""), str(ref.get("namespace") or "")
        )

    async def _patch_pv(self, pv: PersistentVolume, patch: Obj) -> None:
        """Patches the PV; the next sync must see the annotation this one wrote, even before the
        watch delivers it (upstream writes the answer into its informer's cache; kubeloop keeps
        that cache read-only and overlays the answer)."""
        updated = await self.client.patch(PERSISTENT_VOLUMES, pv["metadata"]["name"], patch)
        self.volume_view.mutated(updated)

    def _in_use(self, claim: PersistentVolumeClaim) -> bool:
        """True when the driver said this volume cannot grow while in use and a running pod uses it."""
        key = key_of(claim)
        if key not in self.in_use or self.pods is None:
            return False
        return any(
            (pod_view(p).get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            for p in self.pods.store.by_index(CLAIMS_BY_POD, key)
        )

    async def _patch_claim(
        self,
        claim: PersistentVolumeClaim,
        status: Obj,
        *,
        annotations: dict[str, str | None] | None = None,
        resource_version: bool = True,
    ) -> PersistentVolumeClaim:
        """Merge-patches the claim's status subresource from its cached status to `status`."""
        metadata: Obj = {}
        if resource_version:
            metadata["resourceVersion"] = claim["metadata"]["resourceVersion"]
        current = claim["metadata"].get("annotations") or {}
        changed = {k: v for k, v in (annotations or {}).items() if current.get(k) != v}
        if changed:
            metadata["annotations"] = changed
        body: Obj = {"status": rs.status_patch(claim.get("status") or {}, status)}
        if metadata:
            body["metadata"] = metadata
        updated = await self.client.patch(
            PERSISTENT_VOLUME_CLAIMS,
            claim["metadata"]["name"],
            body,
            namespace=claim["metadata"]["namespace"],
            subresource="status",
        )
        self.claim_view.mutated(updated)  # the next step of this attempt reads what it wrote
        return pvc_view(updated)


class ResizerProcess:
    """The controllers of one external-resizer process, on one informer factory as upstream runs
    them: the resizer, and the modify controller when the driver says MODIFY_VOLUME. They share
    the caches and the one overlay of this process's own writes."""

    def __init__(
        self, context: ControllerContext, csi: CSIConnection, options: Options | None = None
    ) -> None:
        options = options or Options()
        self.resizer = Resizer(context, csi, options)
        self.modifier: Modifier | None = None
        if csi.has_controller_capability(ControllerRPC.MODIFY_VOLUME):
            self.modifier = Modifier(
                context,
                csi,
                claim_view=self.resizer.claim_view,
                volume_view=self.resizer.volume_view,
                serves=self.resizer.serves,
                workers=options.workers,
                timeout=options.modify_timeout,
                retry_start=options.retry_start,
                retry_max=options.retry_max,
                extra_metadata=options.extra_modify_metadata,
            )
        else:
            log.info("Modify not supported", driver=csi.driver_name)

    @property
    def synced(self) -> bool:
        return self.resizer.synced

    async def run(self) -> None:
        try:
            await asyncio.gather(self.resizer.run(), *([self.modifier.run()] if self.modifier else []))
        finally:
            # The informers, this node's Node and pods among them in node deployment.
            await self.resizer.factory.stop()
