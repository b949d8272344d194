"""The binder's own contract strings, worded exactly as kcm's persistentvolume-binder words them
(docs/contracts.md): its event source, event reasons and messages. The annotation keys, phases and
reasons it shares with the provisioner are in controller_runtime.storage."""

from __future__ import annotations

from controller_runtime.resize_status import PRE_RESIZE_CAPACITY

COMPONENT = "persistentvolume-controller"  # the event source kcm's binder reports as

# Set on a PV by a resizer whose volume grew while the filesystem did not yet; the binder reports
# this size as the claim's capacity when it binds.
ANN_PRE_RESIZE_CAPACITY = PRE_RESIZE_CAPACITY

# Event reasons
FAILED_BINDING = "FailedBinding"
WAIT_FOR_FIRST_CONSUMER = "WaitForFirstConsumer"
WAIT_FOR_POD_SCHEDULED = "WaitForPodScheduled"
VOLUME_MISMATCH = "VolumeMismatch"
CLAIM_LOST_REASON = "ClaimLost"
CLAIM_MISBOUND = "ClaimMisbound"
EXTERNAL_PROVISIONING = "ExternalProvisioning"
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
