"""The provisioner's writes to claims. csi-provisioner updates a claim (a PUT of the copy it read,
its resourceVersion included) to set or drop `volume.kubernetes.io/selected-node` and its
cloning-protection finalizer; its published RBAC grants `update` on persistentvolumeclaims, not
`patch`, so kubeloop writes them the same way (issue 51). A stale copy is a 409, as before with
the merge patch carrying the resourceVersion."""

from __future__ import annotations

import copy

from controller_runtime.client import ApiClient
from controller_runtime.resources import PERSISTENT_VOLUME_CLAIMS, Obj


async def update_claim_metadata(
    client: ApiClient,
    claim: Obj,
    *,
    finalizers: list[str] | None = None,
    annotations: dict[str, str | None] | None = None,
) -> Obj:
    """PUTs `claim` with its finalizers replaced by `finalizers` (when given) and `annotations`
    set, a None value dropping its key. The informer's copy lacks managedFields; an update
    without them keeps the stored ones."""
    obj = copy.deepcopy(claim)
    md = obj["metadata"]
    if finalizers is not None:
        if finalizers:
            md["finalizers"] = list(finalizers)
        else:
            md.pop("finalizers", None)
    if annotations:
        merged = dict(md.get("annotations") or {})
        for key, value in annotations.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = value
        md["annotations"] = merged
    return await client.update(PERSISTENT_VOLUME_CLAIMS, obj)
