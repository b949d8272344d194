"""The provisioner's own contract strings (docs/contracts.md). The keys, phases and reasons it shares
with the binder are in controller_runtime.storage, so the two can never disagree."""

from __future__ import annotations

PV_FINALIZER = "external-provisioner.volume.kubernetes.io/finalizer"
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

# Event reasons
PROVISIONING = "Provisioning"
PROVISIONING_SUCCEEDED = "ProvisioningSucceeded"
PROVISIONING_CLEANUP_FAILED = "ProvisioningCleanupFailed"


def msg_provisioning(namespace: str, name: str) -> str:
    return f'External provisioner is provisioning volume for claim "{namespace}/{name}"'


def msg_succeeded(pv_name: str) -> str:
    return f"Successfully provisioned volume {pv_name}"


def msg_failed(class_name: str, error: str) -> str:
    return f'failed to provision volume with StorageClass "{class_name}": {error}'


def msg_still_attached(pv_name: str, node: str) -> str:
    return f"persistentvolume {pv_name} is still attached to node {node}"
