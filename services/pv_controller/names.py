"""The exact strings kcm's persistentvolume-binder uses (see /work/shared/CONTRACTS.md): annotation
keys, event reasons and phases. Real tools (kube-scheduler, kubectl, external-provisioner) read them."""

from __future__ import annotations

COMPONENT = "persistentvolume-controller"  # the event source kcm's binder reports as

# Annotations
ANN_BIND_COMPLETED = "pv.kubernetes.io/bind-completed"
ANN_BOUND_BY_CONTROLLER = "pv.kubernetes.io/bound-by-controller"
ANN_PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
ANN_STORAGE_PROVISIONER = "volume.kubernetes.io/storage-provisioner"
ANN_BETA_STORAGE_PROVISIONER = "volume.beta.kubernetes.io/storage-provisioner"
ANN_SELECTED_NODE = "volume.kubernetes.io/selected-node"
ANN_BETA_STORAGE_CLASS = "volume.beta.kubernetes.io/storage-class"
ANN_MIGRATED_TO = "pv.kubernetes.io/migrated-to"
ANN_DEFAULT_CLASS = "storageclass.kubernetes.io/is-default-class"
ANN_BETA_DEFAULT_CLASS = "storageclass.beta.kubernetes.io/is-default-class"
NO_PROVISIONER = "kubernetes.io/no-provisioner"
YES = "yes"

# Phases
PV_PENDING = "Pending"
PV_AVAILABLE = "Available"
PV_BOUND = "Bound"
PV_RELEASED = "Released"
PV_FAILED = "Failed"
CLAIM_PENDING = "Pending"
CLAIM_BOUND = "Bound"
CLAIM_LOST = "Lost"

# Reclaim policies
RETAIN = "Retain"
DELETE = "Delete"
RECYCLE = "Recycle"

# Event reasons
FAILED_BINDING = "FailedBinding"
WAIT_FOR_FIRST_CONSUMER = "WaitForFirstConsumer"
WAIT_FOR_POD_SCHEDULED = "WaitForPodScheduled"
VOLUME_MISMATCH = "VolumeMismatch"
CLAIM_LOST_REASON = "ClaimLost"
CLAIM_MISBOUND = "ClaimMisbound"
EXTERNAL_PROVISIONING = "ExternalProvisioning"
PROVISIONING_FAILED = "ProvisioningFailed"
VOLUME_FAILED_DELETE = "VolumeFailedDelete"
VOLUME_FAILED_RECYCLE = "VolumeFailedRecycle"
VOLUME_UNKNOWN_RECLAIM_POLICY = "VolumeUnknownReclaimPolicy"

# Event messages, worded as kcm words them so users can search for them.
MSG_NO_CLASS = "no persistent volumes available for this claim and no storage class is set"
MSG_WAIT_FIRST_CONSUMER = "waiting for first consumer to be created before binding"
MSG_CLAIM_LOST_REFERENCE = "Bound claim has lost reference to PersistentVolume. Data on the volume is lost!"
MSG_CLAIM_LOST_VOLUME = "Bound claim has lost its PersistentVolume. Data on the volume is lost!"
MSG_CLAIM_MISBOUND = "Two claims are bound to the same volume, this one is bound incorrectly"
MSG_UNKNOWN_RECLAIM_POLICY = "Volume has unrecognized PersistentVolumeReclaimPolicy"
MSG_NO_RECYCLER = (
    "No recycler plugin found for the volume! The Recycle reclaim policy is deprecated and not "
    "supported by kubeloop: use Delete (dynamic provisioning) or Retain."
)


def msg_external_provisioning(provisioner: str) -> str:
    return (
        f"Waiting for a volume to be created either by the external provisioner '{provisioner}' "
        "or manually by the system administrator. If volume creation is delayed, please verify that "
        "the provisioner is running and correctly registered."
    )


def msg_wait_pods_scheduled(pods: list[str]) -> str:
    if len(pods) == 1:
        return f"waiting for pod {pods[0]} to be scheduled"
    return f"waiting for pods {','.join(pods)} to be scheduled"
