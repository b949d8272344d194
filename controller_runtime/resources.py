"""The API resources kubeloop reads and writes, and helpers over plain-dict objects."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

Obj = dict[str, Any]
"""An API object as decoded JSON. Caches hold these, never generated model classes."""


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        """The request path. A name or namespace is percent-encoded unless it is made of what a
        validated one can hold: some reach here from fields nobody validates (a claim's
        selected-node annotation, its dataSource name, a volumeName), and `x?y` sent raw read the
        object `x`, as `x#y` did. Encoded, such a name means itself: an object that does not exist."""
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{_segment(namespace)}"
        base += f"/{self.plural}"
        if name:
            base += f"/{_segment(name)}"
            if subresource:
                base += f"/{subresource}"
        return base


# What a validated name is made of (and quote() would keep anyway): sent as it is, no encoding work.
_PLAIN_SEGMENT = re.compile(r"[A-Za-z0-9._~-]+")


def _segment(text: str) -> str:
    return text if _PLAIN_SEGMENT.fullmatch(text) else quote(text, safe="")


NAMESPACES = Resource("", "v1", "namespaces", "Namespace", False)
NODES = Resource("", "v1", "nodes", "Node", False)
PODS = Resource("", "v1", "pods", "Pod", True)
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount", True)
EVENTS = Resource("", "v1", "events", "Event", True)
SECRETS = Resource("", "v1", "secrets", "Secret", True)
TOKEN_REVIEWS = Resource("authentication.k8s.io", "v1", "tokenreviews", "TokenReview", False)
PERSISTENT_VOLUMES = Resource("", "v1", "persistentvolumes", "PersistentVolume", False)
PERSISTENT_VOLUME_CLAIMS = Resource("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True)
STORAGE_CLASSES = Resource("storage.k8s.io", "v1", "storageclasses", "StorageClass", False)
VOLUME_ATTACHMENTS = Resource("storage.k8s.io", "v1", "volumeattachments", "VolumeAttachment", False)
VOLUME_ATTRIBUTES_CLASSES = Resource(
    "storage.k8s.io", "v1", "volumeattributesclasses", "VolumeAttributesClass", False
)
CSI_DRIVERS = Resource("storage.k8s.io", "v1", "csidrivers", "CSIDriver", False)
CSI_NODES = Resource("storage.k8s.io", "v1", "csinodes", "CSINode", False)
CSI_STORAGE_CAPACITIES = Resource("storage.k8s.io", "v1", "csistoragecapacities", "CSIStorageCapacity", True)
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease", True)
VOLUME_SNAPSHOTS = Resource("snapshot.storage.k8s.io", "v1", "volumesnapshots", "VolumeSnapshot", True)
VOLUME_SNAPSHOT_CONTENTS = Resource(
    "snapshot.storage.k8s.io", "v1", "volumesnapshotcontents", "VolumeSnapshotContent", False
)


def typed(obj: Obj, res: Resource) -> Obj:
    """`obj` with its kind and apiVersion: cached objects (list items) carry neither, and an
    Event's involvedObject needs both."""
    if obj.get("kind") == res.kind and obj.get("apiVersion") == res.api_version:
        return obj
    return {**obj, "kind": res.kind, "apiVersion": res.api_version}


def name_of(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("name", ""))


def namespace_of(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("namespace", ""))


def resource_version(obj: Obj) -> str:
    return str(obj.get("metadata", {}).get("resourceVersion", ""))


def revision_of(obj: Obj) -> int:
    """The resourceVersion as the etcd revision it is (0 when absent). Kubernetes calls it opaque,
    yet kcm's pv-controller and the scheduler's assume cache compare it as a number to keep a
    controller's own write over an older copy the watch has not replaced yet; so does kubeloop."""
    try:
        return int(obj.get("metadata", {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


def newer(candidate: Obj, held: Obj | None) -> bool:
    """Whether `candidate` may replace `held`. resourceVersions come from one etcd revision counter,
    so a re-created object (another UID) is newer too; equal versions are the same object."""
    return held is None or revision_of(candidate) >= revision_of(held)


def object_key(namespace: str | None, name: str) -> str:
    """The cache key client-go uses: `namespace/name`, or `name` for cluster-scoped objects."""
    return f"{namespace}/{name}" if namespace else name


def key_of(obj: Mapping[str, Any]) -> str:
    """An object's cache key, from its metadata."""
    md = obj.get("metadata", {})
    return object_key(md.get("namespace"), str(md["name"]))


def reference_key(ref: Mapping[str, Any]) -> str:
    """The cache key of the object a reference (claimRef, involvedObject...) names."""
    return object_key(ref.get("namespace"), str(ref.get("name", "")))


def split_key(key: str) -> tuple[str | None, str]:
    ns, sep, name = key.partition("/")
    return (ns, name) if sep else (None, key)
