"""The external-resizer's modify controller (VolumeAttributesClass, GA since Kubernetes 1.34): a
bound claim whose `spec.volumeAttributesClassName` differs from the class its volume has gets
ControllerModifyVolume with the new class's parameters, then the PV's
`spec.volumeAttributesClassName` and the claim's `status.currentVolumeAttributesClassName`.

As kubernetes-csi external-resizer's pkg/modifycontroller writes it:
  1. a class that does not exist: Warning VolumeModifyFailed, `modifyVolumeStatus.status` Pending;
  2. `modifyVolumeStatus` {target, InProgress} and condition ModifyingVolume, Normal VolumeModify;
  3. ControllerModifyVolume; on success the PV, then the claim (status cleared, current = target,
     conditions gone), Normal VolumeModifySuccessful;
  4. on failure condition ModifyVolumeError (reason: the gRPC code), Warning VolumeModifyFailed;
     INVALID_ARGUMENT is Infeasible and retried only once per --retry-interval-max, other final
     codes stay InProgress, and after a code that may leave the call running the same target is
     repeated whatever the claim asks meanwhile (upstream's uncertain claims).
A claim set back to its current class is modified back (the rollback of an Infeasible class); a
claim asking for no class cancels what is shown (VolumeModifyCanceled).

kubeloop goes one step past upstream: a claim left Pending for a class that did not exist is
tried again as soon as that class is created, not at the next resync.
"""

from __future__ import annotations

from collections.abc import Callable

from controller_runtime.client import ApiError
from controller_runtime.clock import now_rfc3339
from controller_runtime.controller import ControllerContext, run_workers
from controller_runtime.csi_client import CSIConnection, SidecarController, error_text, go_code
from controller_runtime.csi_errors import MODIFY_VOLUME, classify, status_code
from controller_runtime.informer import EventHandler
from controller_runtime.kinds import PersistentVolume, PersistentVolumeClaim, as_obj, pv_view, pvc_view
from controller_runtime.logs import get_logger
from controller_runtime.mutation_cache import MutationCache
from controller_runtime.resources import (
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    VOLUME_ATTRIBUTES_CLASSES,
    Obj,
    key_of,
    typed,
)
from controller_runtime.secrets import read_csi_secrets
from controller_runtime.volumes import csi_volume
from controller_runtime.workqueue import ItemExponentialRateLimiter, WorkQueue
from kubeloop_grpc.csi import csi_pb2

from .decide import (
    EVENT_MODIFY_CANCELED,
    EVENT_MODIFY_FAILED,
    EVENT_MODIFY_SUCCESSFUL,
    EVENT_VOLUME_MODIFY,
    MODIFY_IN_PROGRESS,
    MODIFY_INFEASIBLE,
    MODIFY_PENDING,
    MSG_MODIFY_CANCELED,
    ModifyFailure,
    Step,
    cancel_patch,
    infeasible,
    modify_completed_patch,
    modify_plan,
    modify_status_patch,
    retried_slowly,
)

log = get_logger("external-resizer.modify")

CLAIMS_BY_CLASS = "volumeAttributesClassName"
# Where a PV names the Secret ControllerModifyVolume needs (the provisioner copies them from the
# class's csi.storage.k8s.io/controller-modify-secret-* parameters); without them the
# controller-expand Secret is used, as upstream.
ANN_MODIFY_SECRET_NAME = "volume.kubernetes.io/controller-modify-secret-name"
ANN_MODIFY_SECRET_NAMESPACE = "volume.kubernetes.io/controller-modify-secret-namespace"
# --extra-modify-metadata adds these to the class's parameters.
PARAM_PVC_NAME = "csi.storage.k8s.io/pvc/name"
PARAM_PVC_NAMESPACE = "csi.storage.k8s.io/pvc/namespace"
PARAM_PV_NAME = "csi.storage.k8s.io/pv/name"


class ModifyError(Exception):
    """A sync that failed: retried with the queue's backoff."""


class SlowSet:
    """Claims whose class proved Infeasible, each tried again only once `interval` has passed since
    it was first marked (csi-lib-utils' slowset: marking again does not extend the wait)."""

    def __init__(self, interval: float, now: Callable[[], float]) -> None:
        self.interval, self.now = interval, now
        self.since: dict[str, float] = {}

    def remaining(self, key: str) -> float:
        """Seconds left for `key`, 0 when it is not (or no longer) held back."""
        since = self.since.get(key)
        if since is None:
            return 0.0
        left = since + self.interval - self.now()
        if left <= 0:
            del self.since[key]
            return 0.0
        return left

    def mark(self, key: str) -> None:
        if self.remaining(key) == 0:
            self.since[key] = self.now()

    def remove(self, key: str) -> None:
        self.since.pop(key, None)


class Modifier(SidecarController):
    def __init__(
        self,
        context: ControllerContext,
        csi: CSIConnection,
        *,
        claim_view: MutationCache,
        volume_view: MutationCache,
        serves: Callable[[PersistentVolume], bool],
        workers: int,
        timeout: float,
        retry_start: float,
        retry_max: float,
        extra_metadata: bool = False,
    ) -> None:
        super().__init__(context, csi)
        self.claim_view, self.volume_view, self.serves = claim_view, volume_view, serves
        self.workers, self.timeout, self.extra_metadata = workers, timeout, extra_metadata
        self.queue: WorkQueue[str] = WorkQueue(
            f"{self.driver}-pvc-modify", ItemExponentialRateLimiter(retry_start, retry_max), clock=self.clock
        )
        self.claims = self.factory.informer(PERSISTENT_VOLUME_CLAIMS)
        self.volumes = self.factory.informer(PERSISTENT_VOLUMES)
        self.classes = self.factory.informer(VOLUME_ATTRIBUTES_CLASSES)
        self.claims.add_index(CLAIMS_BY_CLASS, lambda c: _class_of(pvc_view(c)))
        self.claims.add_handler(
            EventHandler(lambda c: self.queue.add(key_of(c)), self._claim_updated, self._claim_deleted)
        )
        self.classes.add_handler(EventHandler(self._class_added, None, None))
        # In memory only, as upstream: claims whose last ControllerModifyVolume may still be
        # running (at start: every claim shown InProgress), and claims held back as Infeasible.
        self.uncertain: set[str] = set()
        self.slow = SlowSet(retry_max, self.clock.monotonic)

    # -- handlers: enqueue only -------------------------------------------------------------------

    def _claim_updated(self, old_obj: Obj, new_obj: Obj) -> None:
        old, new = pvc_view(old_obj), pvc_view(new_obj)
        status = new.get("status") or {}
        asked = _class_of(old) != _class_of(new) or status.get("modifyVolumeStatus") is None
        if asked and status.get("phase") == "Bound":
            if self.volume_view.get((old.get("spec") or {}).get("volumeName") or "") is None:
                return  # upstream's check: a claim whose PV is not cached yet waits for a resync
            self.queue.add(key_of(new))

    def _claim_deleted(self, claim: Obj) -> None:
        key = key_of(claim)
        self.queue.forget(key)
        self.uncertain.discard(key)
        self.slow.remove(key)

    def _class_added(self, vac: Obj) -> None:
        """Claims left Pending for a class that was not there are tried again once it is."""
        for claim in self.claims.store.by_index(CLAIMS_BY_CLASS, vac["metadata"]["name"]):
            self.queue.add(key_of(claim))

    async def run(self) -> None:
        """Runs on the informers the resizer starts (one factory)."""
        await self.factory.wait_for_sync()
        for claim in map(pvc_view, self.claims.store.values()):
            status = (claim.get("status") or {}).get("modifyVolumeStatus") or {}
            if status.get("status") == MODIFY_IN_PROGRESS:
                self.uncertain.add(key_of(claim))
        log.info("starting the modify controller", driver=self.driver, uncertain=len(self.uncertain))
        await run_workers(self.queue, self.sync, self.workers)

    # -- the sync ---------------------------------------------------------------------------------

    async def sync(self, key: str) -> float | None:
        claim = pvc_view(self.claim_view.get(key))
        if claim is None:
            return None
        pv_name = (claim.get("spec") or {}).get("volumeName")
        if not pv_name:
            return None
        pv = pv_view(self.volume_view.get(pv_name))
        if pv is None:
            raise ModifyError(f'Get PV "{pv_name}" of pvc "{key}" in PVInformer cache failed: not found')
        vol = csi_volume(pv)
        if vol is None or vol.driver != self.driver or not self.serves(pv):
            return None
        if (claim.get("status") or {}).get("phase") != "Bound":
            return None
        # Infeasible for what the claim still asks: once per --retry-interval-max.
        if not retried_slowly(claim):
            self.slow.remove(key)
        else:
            remaining = self.slow.remaining(key)
            if infeasible(claim):
                self.slow.mark(key)
            if remaining > 0:
                log.debug(
                    f"skipping volume modification for pvc {key}, because modification previously "
                    "failed with infeasible error",
                    retry_in=round(remaining, 1),
                )
                return remaining
        await self._modify(key, claim, pv)
        return None

    async def _modify(self, key: str, claim: PersistentVolumeClaim, pv: PersistentVolume) -> None:
        plan = modify_plan(claim, key in self.uncertain)
        if plan.step is Step.NONE:
            return
        obj = typed(as_obj(claim), PERSISTENT_VOLUME_CLAIMS)
        if plan.step is Step.CANCEL:
            patch = cancel_patch(claim)
            if patch is not None:
                self.recorder.normal(obj, EVENT_MODIFY_CANCELED, MSG_MODIFY_CANCELED)
                try:
                    await self._patch_claim(claim, patch, resource_version=False)
                except ApiError as e:
                    name = claim["metadata"]["name"]
                    raise ModifyError(f'mark PVC "{name}" as rolled back failed: {e}') from e
            return
        vac = self.classes.store.get(plan.target)
        if vac is None:
            self.recorder.warning(obj, EVENT_MODIFY_FAILED, f'VAC "{plan.target}" does not exist.')
            if plan.step is Step.CONTINUE:
                raise ModifyError(
                    f"get VAC with vac name {plan.target} in VACInformer cache failed: not found"
                )
            # Pending until the class appears (its creation wakes the claim).
            await self._mark(claim, MODIFY_PENDING)
            return
        if plan.step is Step.MODIFY:
            claim = await self._mark(claim, MODIFY_IN_PROGRESS)
            self.recorder.normal(
                obj,
                EVENT_VOLUME_MODIFY,
                f"external resizer is modifying volume {claim['metadata']['name']} with vac {plan.target}",
            )
        await self._call(key, claim, pv, vac)

    async def _call(self, key: str, claim: PersistentVolumeClaim, pv: PersistentVolume, vac: Obj) -> None:
        vol = csi_volume(pv)
        assert vol is not None
        name, target = claim["metadata"]["name"], vac["metadata"]["name"]
        params = dict(vac.get("parameters") or {})
        if self.extra_metadata:
            params.update(
                {
                    PARAM_PVC_NAME: name,
                    PARAM_PVC_NAMESPACE: claim["metadata"]["namespace"],
                    PARAM_PV_NAME: pv["metadata"]["name"],
                }
            )
        try:
            secrets = await self._secrets(pv)
            req = csi_pb2.ControllerModifyVolumeRequest(
                volume_id=vol.handle, secrets=secrets, mutable_parameters=params
            )
            await self.csi.controller.ControllerModifyVolume(req, timeout=self.timeout)
        except Exception as exc:
            raise await self._failed(key, claim, target, exc) from exc
        self.uncertain.discard(key)
        try:
            await self._patch_pv(pv, {"spec": {"volumeAttributesClassName": target}})
        except ApiError as e:
            raise ModifyError(
                f"modify volume failed to mark pvc {name} modify volume completed: update "
                f'pv.Spec.VolumeAttributesClassName for PVC "{name}" failed, errored with: {e}'
            ) from e
        try:
            await self._patch_claim(claim, modify_completed_patch(claim, target), resource_version=False)
        except ApiError as e:
            raise ModifyError(
                f"modify volume failed to mark pvc {name} modify volume completed: "
                f'mark PVC "{name}" as ModifyVolumeCompleted failed, errored with: {e}'
            ) from e
        self.recorder.normal(
            typed(as_obj(claim), PERSISTENT_VOLUME_CLAIMS),
            EVENT_MODIFY_SUCCESSFUL,
            f"external resizer modified volume {name} with vac {target} successfully",
        )
        log.info("modified volume", pvc=key, pv=pv["metadata"]["name"], vac=target)

    async def _failed(
        self, key: str, claim: PersistentVolumeClaim, target: str, exc: BaseException
    ) -> ModifyError:
        """What a failed ControllerModifyVolume leaves on the claim; the error the sync fails with."""
        code = status_code(exc)
        text = error_text(exc)
        if code is None:
            return ModifyError(f"cannot get error status from modify volume err: {text}")
        final = classify(MODIFY_VOLUME, code).final
        state = MODIFY_IN_PROGRESS
        if not final:
            self.uncertain.add(key)
            text += f". Still modifying to VAC {target}"
        else:
            self.uncertain.discard(key)
            if code.name == "INVALID_ARGUMENT":
                state = MODIFY_INFEASIBLE
        details = exc.details() if hasattr(exc, "details") else str(exc)
        failure = ModifyFailure(go_code(code), str(details or ""), final)
        try:
            claim = await self._mark(claim, state, failure)
        except ModifyError as e:
            return e
        if infeasible(claim):
            self.slow.mark(key)
        self.recorder.warning(typed(as_obj(claim), PERSISTENT_VOLUME_CLAIMS), EVENT_MODIFY_FAILED, text)
        return ModifyError(text)

    async def _mark(
        self, claim: PersistentVolumeClaim, state: str, failure: ModifyFailure | None = None
    ) -> PersistentVolumeClaim:
        patch = modify_status_patch(claim, state, now_rfc3339(), failure)
        try:
            return await self._patch_claim(claim, patch, resource_version=True)
        except ApiError as e:
            raise ModifyError(
                f'mark PVC "{claim["metadata"]["name"]}" as modify volume failed, errored with: {e}'
            ) from e

    async def _secrets(self, pv: PersistentVolume) -> dict[str, str]:
        annotations = pv["metadata"].get("annotations") or {}
        name = annotations.get(ANN_MODIFY_SECRET_NAME)
        namespace = annotations.get(ANN_MODIFY_SECRET_NAMESPACE)
        if not name:
            ref = ((pv.get("spec") or {}).get("csi") or {}).get("controllerExpandSecretRef") or {}
            name, namespace = ref.get("name"), ref.get("namespace")
        if not name:
            return {}
        return await read_csi_secrets(self.client, str(name), str(namespace or ""))

    async def _patch_pv(self, pv: PersistentVolume, patch: Obj) -> None:
        updated = await self.client.patch(PERSISTENT_VOLUMES, pv["metadata"]["name"], patch)
        self.volume_view.mutated(updated)

    async def _patch_claim(
        self, claim: PersistentVolumeClaim, status: Obj, *, resource_version: bool
    ) -> PersistentVolumeClaim:
        """A strategic merge patch of the claim's status (conditions merge by type, as upstream's
        two-way patch), with the resourceVersion read when the write must not cross another."""
        body: Obj = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": claim["metadata"]["resourceVersion"]}
        updated = await self.client.patch(
            PERSISTENT_VOLUME_CLAIMS,
            claim["metadata"]["name"],
            body,
            namespace=claim["metadata"]["namespace"],
            patch_type="strategic",
            subresource="status",
        )
        self.claim_view.mutated(updated)
        return pvc_view(updated)


def _class_of(claim: PersistentVolumeClaim) -> list[str]:
    name = (claim.get("spec") or {}).get("volumeAttributesClassName")
    return [name] if name else []
