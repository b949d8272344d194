"""The owner of the CSIStorageCapacity objects (--capacity-ownerref-level), found as upstream's
pkg/owner does: start at this pod (POD_NAME in NAMESPACE) and walk up its controlling owner
references. Level 0 is the pod itself, 1 its controller (a DaemonSet or StatefulSet, or a
ReplicaSet), 2 that one's (a ReplicaSet's Deployment), and so on; -1 means no owner. The last
step is taken from the reference alone, so level 1 needs permission to read pods only."""

from __future__ import annotations

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.resources import PODS, Obj, Resource


class OwnerLookupError(Exception):
    """The walk could not finish: the process does not start, as upstream's does not."""


def reference(api_version: str, kind: str, name: str, uid: str) -> Obj:
    """An owner reference as upstream writes it: a controller reference, without
    blockOwnerDeletion."""
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid, "controller": True}


def controller_of(obj: Obj) -> Obj | None:
    """The object's controlling owner reference, if it has one."""
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def _resource(api_version: str, kind: str) -> Resource:
    """The resource of a namespaced owner kind. Workload kinds' plurals are their lower-case
    names with an `s` (ReplicaSet, Deployment, DaemonSet, StatefulSet, Job), which is all an
    owner chain above a pod holds in practice."""
    group, _, version = api_version.rpartition("/")
    return Resource(group, version, kind.lower() + "s", kind, True)


async def lookup(client: ApiClient, namespace: str, pod: str, level: int) -> Obj:
    """The owner reference `level` steps above the pod. Raises OwnerLookupError with upstream's
    words when an object cannot be read or has no controlling owner."""
    api_version, kind, name = "v1", "Pod", pod
    resource = PODS
    while True:
        try:
            obj = await client.get(resource, name, namespace)
        except ApiError as exc:
            raise OwnerLookupError(f"get object: {exc.message}") from exc
        if level == 0:
            return reference(api_version, kind, name, obj["metadata"]["uid"])
        owner = controller_of(obj)
        if owner is None:
            raise OwnerLookupError(
                f'{api_version}/{kind} "{name}" in namespace "{namespace}" has no controlling owner, '
                "cannot unwind the ownership further"
            )
        if level == 1:
            return reference(owner["apiVersion"], owner["kind"], owner["name"], owner["uid"])
        api_version, kind, name = owner["apiVersion"], owner["kind"], owner["name"]
        resource = _resource(api_version, kind)
        level -= 1
