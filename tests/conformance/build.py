"""Builders that keep scenarios short: objects as the Go unit tests set them up, and conditions.

Objects use the scenario's local names; the runner localises them (tests/conformance/model.py).
A PV's handle `{vol:<name>}` is the handle of the DriverVolume step called <name>; a handle
starting with `fake-` is a volume the driver has never heard of (enough for binding scenarios).
In conditions and in Patch/Delete, a PV may be named `claim:<claim>` (the PV the claim is bound
to, for provisioned volumes whose name is generated) and a VolumeAttachment `<pv>@<node>`.
"""

from __future__ import annotations

from csi_driver import DRIVER_NAME, TOPOLOGY_KEY

from .model import Condition, Create, Delete, Obj, Patch, Sleep, Wait

GiB = "1Gi"
RWO = ("ReadWriteOnce",)
ROX = ("ReadOnlyMany",)
RWX = ("ReadWriteMany",)
RWOP = ("ReadWriteOncePod",)
# A UID no claim ever has: the claimRef of a volume whose claim was deleted and created again.
STALE_UID = "00000000-0000-0000-0000-00000000dead"
ANN_BOUND_BY_CONTROLLER = "pv.kubernetes.io/bound-by-controller"
ANN_PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
ANN_SELECTED_NODE = "volume.kubernetes.io/selected-node"


def pv(
    name: str,
    size: str = GiB,
    *,
    modes: tuple[str, ...] | None = RWO,
    sc: str = "",
    claim: str | None = None,
    claim_uid: str | None = None,
    reclaim: str = "Retain",
    block: bool = False,
    vol: str | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    node: str | None = None,
) -> Create:
    csi: Obj = {"driver": DRIVER_NAME, "volumeHandle": f"{{vol:{vol}}}" if vol else f"fake-{name}"}
    if not block:
        csi["fsType"] = "ext4"
    spec: Obj = {
        "capacity": {"storage": size},
        "persistentVolumeReclaimPolicy": reclaim,
        "storageClassName": sc,
        "volumeMode": "Block" if block else "Filesystem",
        "csi": csi,
    }
    if modes is not None:
        spec["accessModes"] = list(modes)
    if claim is not None:
        ref: Obj = {"kind": "PersistentVolumeClaim", "apiVersion": "v1", "namespace": "", "name": claim}
        if claim_uid:
            ref["uid"] = claim_uid
        spec["claimRef"] = ref
    if node is not None:
        term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}
        spec["nodeAffinity"] = {"required": {"nodeSelectorTerms": [term]}}
    md: Obj = {"name": name}
    if labels:
        md["labels"] = labels
    if annotations:
        md["annotations"] = annotations
    return Create({"kind": "PersistentVolume", "metadata": md, "spec": spec})


def pvc(
    name: str,
    size: str = GiB,
    *,
    modes: tuple[str, ...] = RWO,
    sc: str | None = "",
    volume: str | None = None,
    selector: Obj | None = None,
    block: bool = False,
    annotations: dict[str, str] | None = None,
    source: Obj | None = None,
) -> Create:
    """`sc=None` leaves storageClassName unset (the default class admission fills it in)."""
    spec: Obj = {
        "accessModes": list(modes),
        "resources": {"requests": {"storage": size}},
        "volumeMode": "Block" if block else "Filesystem",
    }
    if sc is not None:
        spec["storageClassName"] = sc
    if volume is not None:
        spec["volumeName"] = volume
    if selector is not None:
        spec["selector"] = selector
    if source is not None:
        spec["dataSource"] = source
    md: Obj = {"name": name}
    if annotations:
        md["annotations"] = annotations
    return Create({"kind": "PersistentVolumeClaim", "metadata": md, "spec": spec})


def sc(
    name: str,
    *,
    binding: str | None = "Immediate",
    reclaim: str = "Delete",
    expand: bool = True,
    provisioner: str = DRIVER_NAME,
    params: dict[str, str] | None = None,
    topology: list[str] | None = None,
    mount_options: list[str] | None = None,
) -> Create:
    obj: Obj = {
        "kind": "StorageClass",
        "metadata": {"name": name},
        "provisioner": provisioner,
        "reclaimPolicy": reclaim,
        "allowVolumeExpansion": expand,
        "parameters": {"csi.storage.k8s.io/fstype": "ext4", **(params or {})},
    }
    if binding is not None:
        obj["volumeBindingMode"] = binding
    if mount_options is not None:
        obj["mountOptions"] = mount_options
    if topology is not None:
        obj["allowedTopologies"] = [{"matchLabelExpressions": [{"key": TOPOLOGY_KEY, "values": topology}]}]
    return Create(obj)


def pod(
    name: str,
    *claims: str,
    node: str | None = None,
    on: str | None = None,
    read_only: bool = False,
    block: bool = False,
) -> Create:
    """A pause pod using `claims`: `node` sets spec.nodeName (no scheduler), `on` a hostname
    nodeSelector (the scheduler places it, and binds WaitForFirstConsumer claims)."""
    container: Obj = {"name": "app", "image": "registry.k8s.io/pause:3.10"}
    if block:
        container["volumeDevices"] = [
            {"name": f"v{i}", "devicePath": f"/dev/xvd{i}"} for i in range(len(claims))
        ]
    else:
        container["volumeMounts"] = [{"name": f"v{i}", "mountPath": f"/data{i}"} for i in range(len(claims))]
    spec: Obj = {
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
        "volumes": [
            {"name": f"v{i}", "persistentVolumeClaim": {"claimName": c, "readOnly": read_only}}
            for i, c in enumerate(claims)
        ],
    }
    if node is not None:
        spec["nodeName"] = node
    if on is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": on}
    return Create({"kind": "Pod", "metadata": {"name": name}, "spec": spec})


def secret(name: str, **data: str) -> Create:
    return Create({"kind": "Secret", "metadata": {"name": name}, "stringData": data})


def snapshot(name: str, claim: str, snapshot_class: str = "kubeloop") -> Create:
    """A VolumeSnapshot of `claim` (the VolumeSnapshotClass `kubeloop` comes with the stack's
    csi-snapshotter); its content is `snapshot:<name>` in steps."""
    spec = {"volumeSnapshotClassName": snapshot_class, "source": {"persistentVolumeClaimName": claim}}
    return Create({"kind": "VolumeSnapshot", "metadata": {"name": name}, "spec": spec})


def snapshot_source(name: str) -> Obj:
    """A claim's dataSource naming the VolumeSnapshot `name`."""
    return {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": name}


def phase(kind: str, name: str, value: str) -> Condition:
    return Condition(kind, name, "status.phase", value)


def bound(claim: str) -> Condition:
    return phase("pvc", claim, "Bound")


def running(name: str) -> Condition:
    return phase("pod", name, "Running")


def field(kind: str, name: str, path: str, value: object) -> Condition:
    return Condition(kind, name, path, value)


def exists(kind: str, name: str) -> Condition:
    return Condition(kind, name)


def gone(kind: str, name: str) -> Condition:
    return Condition(kind, name, exists=False)


def event(kind: str, name: str, reason: str) -> Condition:
    return Condition(kind, name, event_reason=reason)


def attached(pv_name: str, node: str) -> Condition:
    return Condition("va", f"{pv_name}@{node}", "status.attached", True)


def wait(*conditions: Condition, timeout: float = 60.0) -> Wait:
    return Wait(tuple(conditions), timeout)


def patch(kind: str, name: str, body: Obj, subresource: str | None = None) -> Patch:
    return Patch(kind, name, body, subresource)


def delete(kind: str, name: str, grace_seconds: int | None = None) -> Delete:
    return Delete(kind, name, grace_seconds)


def resize(claim: str, size: str) -> Patch:
    return Patch("pvc", claim, {"spec": {"resources": {"requests": {"storage": size}}}})


def sleep(seconds: float) -> Sleep:
    return Sleep(seconds)
