"""Typed views of the API objects the controllers decide on: PersistentVolume, PersistentVolumeClaim,
VolumeAttachment, Pod (its volume sources), Node, StorageClass, CSIDriver, CSINode, VolumeSnapshot
and VolumeSnapshotContent, as `TypedDict`s (kopf's typed bodies are the model). A view lists only
the fields kubeloop reads, under the API's own names, all optional (`total=False`): an object from
the API may omit any of them.

A view is a type, not a copy: the informers keep handing out `resources.Obj` (a plain dict), and
the code that decides converts it once where it enters, with the helper of its kind (`pv_view`,
`pvc_view`, `pod_view`, `node_view`, `storage_class_view`, `csi_driver_view`, `csi_node_view`,
`volume_attachment_view`, `snapshot_view`, `snapshot_content_view`). The helper is `typing.cast`:
no copy, no validation, no cost; what changes is that mypy checks every subscript read of a field
against these declarations, so a misspelt `["spce"]` fails the lint. (mypy lets `.get` take any
key, by PEP 589; the keys the typed modules read are checked against these declarations by
`tests/unit/test_typed_views.py`.)
"""

from __future__ import annotations

from typing import Any, Final, Generic, TypedDict, TypeVar, cast, overload

from .resources import Obj

K = TypeVar("K")

# -- meta/v1 ---------------------------------------------------------------------------------------


class ManagedFieldsEntry(TypedDict, total=False):
    manager: str
    operation: str
    subresource: str
    time: str


class ObjectMeta(TypedDict, total=False):
    name: str
    namespace: str
    uid: str
    resourceVersion: str
    labels: dict[str, str]
    annotations: dict[str, str]
    finalizers: list[str]
    deletionTimestamp: str
    creationTimestamp: str
    managedFields: list[ManagedFieldsEntry]


class Condition(TypedDict, total=False):
    """The fields a claim's, a pod's and a node's conditions share."""

    type: str
    status: str
    reason: str
    message: str
    lastTransitionTime: str


class KubeObject(TypedDict, total=False):
    """What every object has: the kind's views add their spec and status."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta


class ObjectReference(TypedDict, total=False):
    """core/v1 ObjectReference, as a PV's spec.claimRef."""

    kind: str
    apiVersion: str
    namespace: str
    name: str
    uid: str
    resourceVersion: str


# -- core/v1 node selectors ------------------------------------------------------------------------


class NodeSelectorRequirement(TypedDict, total=False):
    key: str
    operator: str
    values: list[str]


class NodeSelectorTerm(TypedDict, total=False):
    matchExpressions: list[NodeSelectorRequirement]
    matchFields: list[NodeSelectorRequirement]


class NodeSelector(TypedDict, total=False):
    nodeSelectorTerms: list[NodeSelectorTerm]


class VolumeNodeAffinity(TypedDict, total=False):
    required: NodeSelector


# -- PersistentVolume ------------------------------------------------------------------------------


class SecretReference(TypedDict, total=False):
    name: str
    namespace: str


class CSIPersistentVolumeSource(TypedDict, total=False):
    driver: str
    volumeHandle: str
    fsType: str
    readOnly: bool
    volumeAttributes: dict[str, str]
    controllerPublishSecretRef: SecretReference
    controllerExpandSecretRef: SecretReference


class PersistentVolumeSpec(TypedDict, total=False):
    accessModes: list[str]
    capacity: dict[str, str]
    claimRef: ObjectReference
    csi: CSIPersistentVolumeSource
    mountOptions: list[str]
    nodeAffinity: VolumeNodeAffinity
    persistentVolumeReclaimPolicy: str
    storageClassName: str
    volumeMode: str
    volumeAttributesClassName: str


class PersistentVolumeStatus(TypedDict, total=False):
    phase: str
    message: str
    lastPhaseTransitionTime: str


class PersistentVolume(KubeObject, total=False):
    spec: PersistentVolumeSpec
    status: PersistentVolumeStatus


# -- PersistentVolumeClaim -------------------------------------------------------------------------


class VolumeResourceRequirements(TypedDict, total=False):
    requests: dict[str, str]
    limits: dict[str, str]


class LabelSelectorRequirement(TypedDict, total=False):
    key: str
    operator: str
    values: list[str]


class LabelSelector(TypedDict, total=False):
    matchLabels: dict[str, str]
    matchExpressions: list[LabelSelectorRequirement]


class TypedObjectReference(TypedDict, total=False):
    """A claim's dataSource (no namespace) or dataSourceRef."""

    apiGroup: str
    kind: str
    name: str
    namespace: str


class PersistentVolumeClaimSpec(TypedDict, total=False):
    accessModes: list[str]
    resources: VolumeResourceRequirements
    selector: LabelSelector
    dataSource: TypedObjectReference
    dataSourceRef: TypedObjectReference
    storageClassName: str
    volumeMode: str
    volumeName: str
    volumeAttributesClassName: str


class ModifyVolumeStatus(TypedDict, total=False):
    targetVolumeAttributesClassName: str
    status: str


class PersistentVolumeClaimStatus(TypedDict, total=False):
    phase: str
    accessModes: list[str]
    capacity: dict[str, str]
    conditions: list[Condition]
    currentVolumeAttributesClassName: str
    modifyVolumeStatus: ModifyVolumeStatus
    allocatedResources: dict[str, str]
    allocatedResourceStatuses: dict[str, str]


class PersistentVolumeClaim(KubeObject, total=False):
    spec: PersistentVolumeClaimSpec
    status: PersistentVolumeClaimStatus


# -- Pod (what the volume path reads) --------------------------------------------------------------


class PersistentVolumeClaimVolumeSource(TypedDict, total=False):
    claimName: str
    readOnly: bool


class CSIVolumeSource(TypedDict, total=False):
    """A pod's inline `csi:` volume."""

    driver: str
    readOnly: bool
    fsType: str
    volumeAttributes: dict[str, str]


class Volume(TypedDict, total=False):
    """A pod's volume: its name and the sources kubeloop acts on (a generic ephemeral volume's
    `ephemeral` is only tested for presence)."""

    name: str
    persistentVolumeClaim: PersistentVolumeClaimVolumeSource
    ephemeral: dict[str, Any]
    csi: CSIVolumeSource


class Container(TypedDict, total=False):
    """A pod's container: what the node agent reports of it."""

    name: str
    image: str


class PodSpec(TypedDict, total=False):
    nodeName: str
    serviceAccountName: str
    containers: list[Container]
    volumes: list[Volume]


class ContainerStatus(TypedDict, total=False):
    name: str
    # One key of running, waiting, terminated: only which one is read.
    state: dict[str, Any]


class PodStatus(TypedDict, total=False):
    phase: str
    podIP: str
    startTime: str
    conditions: list[Condition]
    containerStatuses: list[ContainerStatus]


class Pod(KubeObject, total=False):
    spec: PodSpec
    status: PodStatus


# -- Node ------------------------------------------------------------------------------------------


class Taint(TypedDict, total=False):
    key: str
    value: str
    effect: str


class NodeSpec(TypedDict, total=False):
    taints: list[Taint]
    unschedulable: bool


class NodeCondition(Condition, total=False):
    lastHeartbeatTime: str


class AttachedVolume(TypedDict, total=False):
    name: str
    devicePath: str


class NodeStatus(TypedDict, total=False):
    conditions: list[NodeCondition]
    volumesAttached: list[AttachedVolume]
    volumesInUse: list[str]


class Node(KubeObject, total=False):
    spec: NodeSpec
    status: NodeStatus


# -- storage.k8s.io/v1 -----------------------------------------------------------------------------


class TopologySelectorLabelRequirement(TypedDict, total=False):
    key: str
    values: list[str]


class TopologySelectorTerm(TypedDict, total=False):
    """A term of a class's allowedTopologies."""

    matchLabelExpressions: list[TopologySelectorLabelRequirement]


class StorageClass(KubeObject, total=False):
    provisioner: str
    allowedTopologies: list[TopologySelectorTerm]
    parameters: dict[str, str]
    reclaimPolicy: str
    volumeBindingMode: str
    allowVolumeExpansion: bool
    mountOptions: list[str]


class CSIDriverSpec(TypedDict, total=False):
    attachRequired: bool | None  # null: unset (attach)
    podInfoOnMount: bool
    volumeLifecycleModes: list[str]
    fsGroupPolicy: str
    requiresRepublish: bool
    storageCapacity: bool


class CSIDriver(KubeObject, total=False):
    spec: CSIDriverSpec


class CSINodeDriver(TypedDict, total=False):
    name: str
    nodeID: str
    topologyKeys: list[str]
    allocatable: dict[str, int]


class CSINodeSpec(TypedDict, total=False):
    drivers: list[CSINodeDriver]


class CSINode(KubeObject, total=False):
    spec: CSINodeSpec


class VolumeAttachmentSource(TypedDict, total=False):
    persistentVolumeName: str
    inlineVolumeSpec: dict[str, Any]  # migrated in-tree volumes: only tested for presence


class VolumeAttachmentSpec(TypedDict, total=False):
    attacher: str
    nodeName: str
    source: VolumeAttachmentSource


class VolumeError(TypedDict, total=False):
    message: str
    time: str


class VolumeAttachmentStatus(TypedDict, total=False):
    attached: bool
    attachmentMetadata: dict[str, str]
    attachError: VolumeError
    detachError: VolumeError


class VolumeAttachment(KubeObject, total=False):
    spec: VolumeAttachmentSpec
    status: VolumeAttachmentStatus


# -- snapshot.storage.k8s.io/v1 --------------------------------------------------------------------


class VolumeSnapshotSource(TypedDict, total=False):
    persistentVolumeClaimName: str
    volumeSnapshotContentName: str


class VolumeSnapshotSpec(TypedDict, total=False):
    source: VolumeSnapshotSource
    volumeSnapshotClassName: str


class VolumeSnapshotStatus(TypedDict, total=False):
    boundVolumeSnapshotContentName: str
    readyToUse: bool
    restoreSize: str  # a quantity
    creationTime: str
    error: VolumeError


class VolumeSnapshot(KubeObject, total=False):
    spec: VolumeSnapshotSpec
    status: VolumeSnapshotStatus


class VolumeSnapshotContentSource(TypedDict, total=False):
    volumeHandle: str
    snapshotHandle: str


class VolumeSnapshotContentSpec(TypedDict, total=False):
    driver: str
    deletionPolicy: str
    source: VolumeSnapshotContentSource
    sourceVolumeMode: str
    volumeSnapshotClassName: str
    volumeSnapshotRef: ObjectReference


class VolumeSnapshotContentStatus(TypedDict, total=False):
    snapshotHandle: str
    readyToUse: bool
    restoreSize: int  # bytes
    creationTime: int  # nanoseconds since the epoch
    error: VolumeError


class VolumeSnapshotContent(KubeObject, total=False):
    spec: VolumeSnapshotContentSpec
    status: VolumeSnapshotContentStatus


# -- TokenReview (authentication.k8s.io/v1) ------------------------------------------------------


class UserInfo(TypedDict, total=False):
    username: str
    uid: str
    groups: list[str]
    extra: dict[str, list[str]]


class TokenReviewStatus(TypedDict, total=False):
    authenticated: bool
    user: UserInfo
    audiences: list[str]
    error: str


class TokenReview(KubeObject, total=False):
    status: TokenReviewStatus


# -- the boundary: an informer's Obj seen as its kind (a cast: no copy, no validation) --------------


class _View(Generic[K]):
    """The conversion of one kind: `pv_view(obj)` is `obj`, typed as a PersistentVolume (None stays
    None, so a cache miss keeps its `| None`)."""

    @overload
    def __call__(self, obj: Obj) -> K: ...
    @overload
    def __call__(self, obj: None) -> None: ...
    def __call__(self, obj: Obj | None) -> K | None:
        return cast("K | None", obj)


def as_obj(view: KubeObject) -> Obj:
    """A view back as the plain dict it is, for what takes any object (a write's body, an event's
    subject, a cache): a cast too."""
    return cast("Obj", view)


pv_view: Final = _View[PersistentVolume]()
pvc_view: Final = _View[PersistentVolumeClaim]()
pod_view: Final = _View[Pod]()
node_view: Final = _View[Node]()
storage_class_view: Final = _View[StorageClass]()
csi_driver_view: Final = _View[CSIDriver]()
csi_node_view: Final = _View[CSINode]()
volume_attachment_view: Final = _View[VolumeAttachment]()
snapshot_view: Final = _View[VolumeSnapshot]()
snapshot_content_view: Final = _View[VolumeSnapshotContent]()
token_review_view: Final = _View[TokenReview]()
