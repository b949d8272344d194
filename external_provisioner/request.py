"""Pure translation between Kubernetes objects and CSI: a claim and its class become a
`VolumeSpec` (everything CreateVolume needs, serialisable so the intent journal can hold it), and a
created volume becomes the PersistentVolume the provisioner saves. No I/O here."""

from __future__ import annotations

import itertools
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from controller_runtime import storage, volumes
from controller_runtime.quantity import format_quantity
from controller_runtime.resources import Obj
from controller_runtime.storage import claim_class, claim_reference, claim_request
from kubeloop_grpc.csi import csi_pb2

from . import names

Segment = dict[str, str]

_SECRET_KINDS = (
    "provisioner",
    "controller-publish",
    "node-stage",
    "node-publish",
    "controller-expand",
    "node-expand",
)
# Where each secret reference lands in the PV's spec.csi (the provisioner's own is only used here).
_PV_SECRET_FIELDS = {
    "controller-publish": "controllerPublishSecretRef",
    "node-stage": "nodeStageSecretRef",
    "node-publish": "nodePublishSecretRef",
    "controller-expand": "controllerExpandSecretRef",
    "node-expand": "nodeExpandSecretRef",
}
_KNOWN_RESERVED = frozenset(
    {names.PARAM_FSTYPE, names.PARAM_PVC_NAME, names.PARAM_PVC_NAMESPACE, names.PARAM_PV_NAME}
    | {f"{names.PARAMETER_PREFIX}{k}-secret-{part}" for k in _SECRET_KINDS for part in ("name", "namespace")}
)
_TEMPLATE = re.compile(r"\$\{([^}]*)\}")
_ANNOTATION_REF = re.compile(r"^pvc\.annotations\['([^']+)'\]$")


class ProvisionError(Exception):
    """A provisioning attempt that failed. `final` is False when the driver may still be creating
    the volume (the same CreateVolume must be repeated); `reschedule` asks the scheduler to pick
    another node (the selected-node annotation is removed)."""

    def __init__(self, message: str, *, final: bool = True, reschedule: bool = False) -> None:
        super().__init__(message)
        self.final = final
        self.reschedule = reschedule


def pv_name_for(prefix: str, claim: Obj) -> str:
    """`<prefix>-<claim UID>`: both the PV's name and CreateVolume's idempotency key."""
    return f"{prefix}-{claim['metadata']['uid']}"


# -- parameters and secrets ------------------------------------------------------------------------


@dataclass(frozen=True)
class SecretRef:
    name: str
    namespace: str


@dataclass(frozen=True)
class ClassParameters:
    driver: dict[str, str]  # what the driver gets, reserved keys removed
    fs_type: str
    secrets: dict[str, SecretRef]  # by kind: provisioner, node-stage, ...


def _expand(
    template: str, values: Mapping[str, str], annotations: Mapping[str, str] | None, what: str
) -> str:
    def sub(m: re.Match[str]) -> str:
        key = m.group(1)
        if key in values:
            return values[key]
        ann = _ANNOTATION_REF.match(key)
        if ann is not None and annotations is not None:
            if ann.group(1) not in annotations:
                raise ProvisionError(f"{what}: the claim has no annotation {ann.group(1)!r}")
            return annotations[ann.group(1)]
        raise ProvisionError(f"{what}: ${{{key}}} is not allowed in this template")

    return _TEMPLATE.sub(sub, template)


def split_parameters(params: Mapping[str, str], claim: Obj, pv_name: str, default_fs: str) -> ClassParameters:
    """Separates the class's parameters for the driver from the provisioner's own reserved keys,
    resolving secret reference templates. Unknown reserved keys are refused (a typo would otherwise
    silently drop a secret)."""
    md = claim["metadata"]
    unknown = sorted(k for k in params if k.startswith(names.PARAMETER_PREFIX) and k not in _KNOWN_RESERVED)
    if unknown:
        raise ProvisionError(
            f'found unknown parameter key "{unknown[0]}" with reserved namespace {names.PARAMETER_PREFIX}'
        )
    secrets: dict[str, SecretRef] = {}
    for kind in _SECRET_KINDS:
        name_t = params.get(f"{names.PARAMETER_PREFIX}{kind}-secret-name")
        ns_t = params.get(f"{names.PARAMETER_PREFIX}{kind}-secret-namespace")
        if name_t is None and ns_t is None:
            continue
        if not name_t or not ns_t:
            raise ProvisionError(f"{kind} secret: both the name and the namespace parameters must be set")
        ns_values = {"pv.name": pv_name, "pvc.namespace": md["namespace"]}
        # The provisioner's own secret may not depend on what the claim's author writes.
        annotations = None if kind == "provisioner" else (md.get("annotations") or {})
        secrets[kind] = SecretRef(
            name=_expand(name_t, {**ns_values, "pvc.name": md["name"]}, annotations, f"{kind} secret name"),
            namespace=_expand(ns_t, ns_values, None, f"{kind} secret namespace"),
        )
    driver = {k: v for k, v in params.items() if not k.startswith(names.PARAMETER_PREFIX)}
    return ClassParameters(
        driver=driver, fs_type=params.get(names.PARAM_FSTYPE) or default_fs, secrets=secrets
    )


# -- topology --------------------------------------------------------------------------------------


def driver_topology_keys(csinode: Obj | None, driver: str) -> list[str] | None:
    """The topology keys the node's plugin of `driver` reported, None when it has none there."""
    for d in (csinode or {}).get("spec", {}).get("drivers") or []:
        if d.get("name") == driver:
            return list(d.get("topologyKeys") or [])
    return None


def node_segment(node: Obj, keys: Iterable[str]) -> Segment | None:
    labels = node.get("metadata", {}).get("labels") or {}
    keys = list(keys)
    if not keys or any(k not in labels for k in keys):
        return None
    return {k: labels[k] for k in keys}


def allowed_segments(allowed_topologies: list[Obj]) -> list[Segment]:
    """A class's allowedTopologies as segments: each term is the product of its expressions' values."""
    out: list[Segment] = []
    for term in allowed_topologies:
        exprs = term.get("matchLabelExpressions") or []
        keys = [e["key"] for e in exprs]
        for values in itertools.product(*[e.get("values") or [] for e in exprs]):
            segment = dict(zip(keys, values, strict=True))
            if segment and segment not in out:
                out.append(segment)
    return out


def _covers(segment: Segment, other: Segment) -> bool:
    return all(other.get(k) == v for k, v in segment.items())


def _ordered(segments: list[Segment]) -> list[Segment]:
    return sorted(segments, key=lambda s: sorted(s.items()))


@dataclass
class Topology:
    requisite: list[Segment]
    preferred: list[Segment]


def accessibility(
    driver: str,
    storage_class: Obj,
    pv_name: str,
    selected_node: Obj | None,
    csinodes: Iterable[Obj],
    nodes: Mapping[str, Obj],
) -> Topology | None:
    """CreateVolume's accessibility requirements. With a selected node (WaitForFirstConsumer) its
    segment comes first among the preferred ones, so a driver that honours preference places the
    volume where the pod goes; without one, preference is rotated by the volume's name so volumes
    spread over the segments. Requisite: the class's allowedTopologies, else every segment a node
    of this driver reports."""
    selected: Segment | None = None
    if selected_node is not None:
        node_name = selected_node["metadata"]["name"]
        keys = next(
            (
                driver_topology_keys(c, driver)
                for c in csinodes
                if c["metadata"]["name"] == node_name and driver_topology_keys(c, driver) is not None
            ),
            None,
        )
        if keys is None:
            raise ProvisionError(f"the CSINode of selected node {node_name!r} does not list driver {driver}")
        selected = node_segment(selected_node, keys)
        if selected is None:
            raise ProvisionError(f"selected node {node_name!r} lacks the topology labels {', '.join(keys)}")
    allowed = storage_class.get("allowedTopologies") or []
    if allowed:
        requisite = allowed_segments(allowed)
        if selected is not None:
            requisite = [s for s in requisite if _covers(s, selected)] or [selected]
    else:
        seen: list[Segment] = []
        for c in csinodes:
            keys = driver_topology_keys(c, driver)
            node = nodes.get(c["metadata"]["name"])
            segment = node_segment(node, keys) if node is not None and keys else None
            if segment is not None and segment not in seen:
                seen.append(segment)
        if selected is not None:
            # Only segments over the same keys are comparable with the selected one.
            seen = [s for s in seen if s.keys() == selected.keys()]
            if selected not in seen:
                seen.append(selected)
        requisite = seen
    if not requisite:
        return None
    requisite = _ordered(requisite)
    if selected is not None:
        first = [s for s in requisite if _covers(s, selected)][:1] or [selected]
        preferred = first + [s for s in requisite if s not in first]
    else:
        shift = zlib.crc32(pv_name.encode()) % len(requisite)
        preferred = requisite[shift:] + requisite[:shift]
    return Topology(requisite=requisite, preferred=preferred)


# -- the CreateVolume request ----------------------------------------------------------------------


@dataclass
class VolumeSpec:
    """Everything CreateVolume is called with, except secret *values*: the intent journal stores
    this, and secrets must never reach the disk."""

    name: str
    capacity: int
    block: bool
    fs_type: str
    mount_flags: list[str]
    access_modes: list[str]
    parameters: dict[str, str]
    secret: SecretRef | None = None
    topology: Topology | None = None
    source_volume: str = ""
    source_snapshot: str = ""
    multi_writer: bool = True  # the driver has SINGLE_NODE_MULTI_WRITER

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> VolumeSpec:
        doc = dict(doc)
        secret = doc.pop("secret", None)
        topo = doc.pop("topology", None)
        return cls(
            **doc,
            secret=SecretRef(**secret) if secret else None,
            topology=Topology(**topo) if topo else None,
        )

    def to_request(self, secrets: Mapping[str, str] | None = None) -> csi_pb2.CreateVolumeRequest:
        req = csi_pb2.CreateVolumeRequest(
            name=self.name,
            capacity_range=csi_pb2.CapacityRange(required_bytes=self.capacity),
            volume_capabilities=volume_capabilities(
                self.access_modes, self.block, self.fs_type, self.mount_flags, self.multi_writer
            ),
            parameters=self.parameters,
            secrets=dict(secrets or {}),
        )
        if self.topology is not None:
            req.accessibility_requirements.CopyFrom(
                csi_pb2.TopologyRequirement(
                    requisite=[csi_pb2.Topology(segments=s) for s in self.topology.requisite],
                    preferred=[csi_pb2.Topology(segments=s) for s in self.topology.preferred],
                )
            )
        if self.source_volume:
            req.volume_content_source.volume.volume_id = self.source_volume
        elif self.source_snapshot:
            req.volume_content_source.snapshot.snapshot_id = self.source_snapshot
        return req


def csi_access_mode(mode: str, multi_writer: bool) -> int:
    found = volumes.csi_access_mode(mode, multi_writer)
    if found is None:
        raise ProvisionError(f"unsupported access mode {mode!r}")
    return found


def volume_capabilities(
    modes: Iterable[str], block: bool, fs_type: str, mount_flags: list[str], multi_writer: bool
) -> list[csi_pb2.VolumeCapability]:
    return [volumes.capability(csi_access_mode(m, multi_writer), block, fs_type, mount_flags) for m in modes]


def is_block(claim: Obj) -> bool:
    return bool(claim.get("spec", {}).get("volumeMode") == "Block")


def volume_spec(
    claim: Obj,
    storage_class: Obj,
    params: ClassParameters,
    pv_name: str,
    *,
    extra_metadata: bool,
    multi_writer: bool,
    topology: Topology | None,
    source_volume: str = "",
    source_snapshot: str = "",
) -> VolumeSpec:
    md = claim["metadata"]
    modes = list(claim.get("spec", {}).get("accessModes") or [])
    if not modes:
        raise ProvisionError("the claim requests no access modes")
    driver_params = dict(params.driver)
    if extra_metadata:
        driver_params.update(
            {
                names.PARAM_PVC_NAME: md["name"],
                names.PARAM_PVC_NAMESPACE: md["namespace"],
                names.PARAM_PV_NAME: pv_name,
            }
        )
    block = is_block(claim)
    return VolumeSpec(
        name=pv_name,
        capacity=claim_request(claim),
        block=block,
        fs_type="" if block else params.fs_type,
        mount_flags=[] if block else list(storage_class.get("mountOptions") or []),
        access_modes=modes,
        parameters=driver_params,
        secret=params.secrets.get("provisioner"),
        topology=topology,
        source_volume=source_volume,
        source_snapshot=source_snapshot,
        multi_writer=multi_writer,
    )


# -- the PersistentVolume --------------------------------------------------------------------------


@dataclass(frozen=True)
class CreatedVolume:
    volume_id: str
    capacity: int
    context: dict[str, str] = field(default_factory=dict)
    topology: list[Segment] = field(default_factory=list)

    @classmethod
    def from_proto(cls, vol: csi_pb2.Volume) -> CreatedVolume:
        return cls(
            volume_id=vol.volume_id,
            capacity=vol.capacity_bytes,
            context=dict(vol.volume_context),
            topology=[dict(t.segments) for t in vol.accessible_topology if t.segments],
        )


def node_affinity(topology: list[Segment]) -> Obj | None:
    """One node-selector term per accessible segment (terms are ORed, expressions ANDed)."""
    terms = [
        {"matchExpressions": [{"key": k, "operator": "In", "values": [v]} for k, v in sorted(seg.items())]}
        for seg in topology
    ]
    return {"required": {"nodeSelectorTerms": terms}} if terms else None


def build_pv(
    *,
    driver: str,
    identity: str,
    claim: Obj,
    storage_class: Obj,
    spec: VolumeSpec,
    params: ClassParameters,
    created: CreatedVolume,
) -> Obj:
    """The PV for a created volume, pre-bound to its claim: the binder finishes the bind."""
    policy = storage_class.get("reclaimPolicy") or storage.DELETE
    csi: Obj = {
        "driver": driver,
        "volumeHandle": created.volume_id,
        "volumeAttributes": {**created.context, names.PROVISIONER_IDENTITY: identity},
    }
    if not spec.block:
        csi["fsType"] = spec.fs_type
    for kind, fld in _PV_SECRET_FIELDS.items():
        ref = params.secrets.get(kind)
        if ref is not None:
            csi[fld] = {"name": ref.name, "namespace": ref.namespace}
    pv_spec: Obj = {
        "accessModes": list(spec.access_modes),
        "capacity": {"storage": format_quantity(created.capacity or spec.capacity)},
        "csi": csi,
        "claimRef": claim_reference(claim),
        "persistentVolumeReclaimPolicy": policy,
        "storageClassName": claim_class(claim),
        "volumeMode": "Block" if spec.block else "Filesystem",
    }
    if storage_class.get("mountOptions"):
        pv_spec["mountOptions"] = list(storage_class["mountOptions"])
    affinity = node_affinity(created.topology)
    if affinity is not None:
        pv_spec["nodeAffinity"] = affinity
    vac = claim.get("spec", {}).get("volumeAttributesClassName")
    if vac:
        pv_spec["volumeAttributesClassName"] = vac
    metadata: Obj = {"name": spec.name, "annotations": {storage.ANN_PROVISIONED_BY: driver}}
    if policy == storage.DELETE:
        metadata["finalizers"] = [names.PV_FINALIZER]
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": metadata, "spec": pv_spec}
