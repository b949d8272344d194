"""The provisioner's own contract strings (docs/contracts.md). The keys, phases and reasons it shares
with the binder are in controller_runtime.storage, so the two can never disagree."""

from __future__ import annotations

PV_FINALIZER = "external-provisioner.volume.kubernetes.io/finalizer"
# On a claim that is the source of a clone being provisioned: keeps it until no clone of it is Pending.
CLONE_FINALIZER = "provisioner.storage.kubernetes.io/cloning-protection"
# On a VolumeSnapshot that a claim being provisioned restores from.
SNAPSHOT_FINALIZER = "provisioner.storage.kubernetes.io/volumesnapshot-as-source-protection"
# Written on every provisioned PV: the provisioner secret DeleteVolume needs ("" when none).
ANN_DELETION_SECRET_NAME = "volume.kubernetes.io/provisioner-deletion-secret-name"
ANN_DELETION_SECRET_NAMESPACE = "volume.kubernetes.io/provisioner-deletion-secret-namespace"
# Written only when the class names a controller-modify secret (for ControllerModifyVolume).
ANN_MODIFY_SECRET_NAME = "volume.kubernetes.io/controller-modify-secret-name"
ANN_MODIFY_SECRET_NAMESPACE = "volume.kubernetes.io/controller-modify-secret-namespace"
PROVISIONER_IDENTITY = "storage.kubernetes.io/csiProvisionerIdentity"

# Parameters under this prefix are for the provisioner, never passed to the driver as they are.
PARAMETER_PREFIX = "csi.storage.k8s.io/"
PARAM_FSTYPE = PARAMETER_PREFIX + "fstype"
PARAM_PVC_NAME = PARAMETER_PREFIX + "pvc/name"
PARAM_PVC_NAMESPACE = PARAMETER_PREFIX + "pvc/namespace"
PARAM_PV_NAME = PARAMETER_PREFIX + "pv/name"

# CSIStorageCapacity labels, as the Go sidecar writes them.
CAPACITY_LABEL_DRIVER = "csi.storage.k8s.io/drivername"
CAPACITY_LABEL_MANAGED_BY = "csi.storage.k8s.io/managed-by"
CAPACITY_MANAGED_BY = "external-provisioner"
_DNS1035_LABEL_MAX = 63


def _fnv32a(text: str) -> str:
    value = 0x811C9DC5
    for byte in text.encode():
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return f"{value:08x}"


def capacity_managed_by(node: str | None) -> str:
    """The managed-by label value: `external-provisioner`, or in node deployment
    `external-provisioner-<node>` kept within a DNS-1035 label as upstream's getNameWithMaxLength
    does (a long node name is cut and the full name's FNV-1a hash put in between), so each
    node's provisioner finds and replaces only its own objects."""
    if not node:
        return CAPACITY_MANAGED_BY
    name = f"{CAPACITY_MANAGED_BY}-{node}"
    if len(name) <= _DNS1035_LABEL_MAX:
        return name
    keep = _DNS1035_LABEL_MAX - 10 - len(node)
    if keep <= 0:
        return f"{CAPACITY_MANAGED_BY[: _DNS1035_LABEL_MAX - 9]}-{_fnv32a(name)}"[:_DNS1035_LABEL_MAX]
    return f"{CAPACITY_MANAGED_BY[:keep]}-{_fnv32a(CAPACITY_MANAGED_BY)}-{node}"


# Event reasons
PROVISIONING = "Provisioning"
PROVISIONING_SUCCEEDED = "ProvisioningSucceeded"
PROVISIONING_CLEANUP_FAILED = "ProvisioningCleanupFailed"


def msg_provisioning(namespace: str, name: str) -> str:
    return f'External provisioner is provisioning volume for claim "{namespace}/{name}"'


def msg_succeeded(pv_name: str) -> str:
    return f"Successfully provisioned volume {pv_name}"


MSG_POPULATOR = "Assuming an external populator will provision the volume"


def msg_still_attached(pv_name: str, node: str) -> str:
    return f"persistentvolume {pv_name} is still attached to node {node}"


# kubeloop's own (upstream only logs it): on a StorageClass whose parameters GetCapacity refused.
REASON_CAPACITY_FAILED = "GetCapacityFailed"
