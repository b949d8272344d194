"""Pure translation between Kubernetes objects and CSI: a claim and its class become a
`VolumeSpec` (everything CreateVolume needs, serialisable so the intent journal can hold it), and a
created volume becomes the PersistentVolume the provisioner saves. No I/O here."""

from __future__ import annotations

import itertools
import json
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from controller_runtime import storage, volumes
from controller_runtime.csi_errors import OperationState
from controller_runtime.kinds import CSINode, Node, PersistentVolumeClaim, StorageClass, TopologySelectorTerm
from controller_runtime.quantity import format_quantity
from controller_runtime.resources import Obj
from controller_runtime.storage import claim_class, claim_reference, claim_request
from kubeloop_grpc.csi import csi_pb2

from . import names

Segment = dict[str, str]


@dataclass(frozen=True)
class SecretKind:
    """One secret the class can name: the name Go's messages use, the parameter prefix, and the
    pre-`csi.storage.k8s.io/` keys some kinds still accept."""

    kind: str  # provisioner, node-stage, ...
    title: str  # Provisioner, NodeStage, ... as in the error messages
    deprecated: str = ""  # csiProvisionerSecret: the deprecated keys are <this>Name / <this>Namespace

    @property
    def name_key(self) -> str:
        return f"{self._stem}secret-name"

    @property
    def namespace_key(self) -> str:
        return f"{self._stem}secret-namespace"

    @property
    def _stem(self) -> str:
        return f"{names.PARAMETER_PREFIX}{self.kind}-" if self.kind else names.PARAMETER_PREFIX


SECRET_KINDS = (
    SecretKind("provisioner", "Provisioner", "csiProvisionerSecret"),
    SecretKind("node-publish", "NodePublish", "csiNodePublishSecret"),
    SecretKind("controller-publish", "ControllerPublish", "csiControllerPublishSecret"),
    SecretKind("node-stage", "NodeStage", "csiNodeStageSecret"),
    SecretKind("controller-expand", "ControllerExpand"),
    SecretKind("node-expand", "NodeExpand"),
    SecretKind("controller-modify", "ControllerModify"),
)
_BY_KIND = {k.kind: k for k in SECRET_KINDS}
# Used by every kind the class does not name explicitly.
_DEFAULT_SECRET = SecretKind("", "Default")  # csi.storage.k8s.io/secret-name, -namespace
# Where each secret reference lands in the PV's spec.csi (the provisioner's own goes to an
# annotation for DeleteVolume, the controller-modify one to an annotation for the resizer).
_PV_SECRET_FIELDS = {
    "controller-publish": "controllerPublishSecretRef",
    "node-stage": "nodeStageSecretRef",
    "node-publish": "nodePublishSecretRef",
    "controller-expand": "controllerExpandSecretRef",
    "node-expand": "nodeExpandSecretRef",
}
_KNOWN_RESERVED = frozenset(
    {names.PARAM_FSTYPE, names.PARAM_PVC_NAME, names.PARAM_PVC_NAMESPACE, names.PARAM_PV_NAME}
    | {k for kind in (*SECRET_KINDS, _DEFAULT_SECRET) for k in (kind.name_key, kind.namespace_key)}
)
# Every parameter key a secret reference is read from (_templates), so that a class naming no
# secret, as most do, skips the look-ups of all eight kinds: each would find nothing, at 49 us per
# split_parameters, which runs twice for each claim. "" is among them as _templates looks it up for
# the kinds without a deprecated form.
_SECRET_KEYS = frozenset(
    k
    for kind in (*SECRET_KINDS, _DEFAULT_SECRET)
    for k in (
        f"{kind.deprecated}Name" if kind.deprecated else "",
        f"{kind.deprecated}Namespace" if kind.deprecated else "",
        kind.name_key,
        kind.namespace_key,
    )
)
_SHELL_SPECIAL = frozenset("*#$@!?-0123456789")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class ProvisionError(Exception):
    """A provisioning or deletion attempt that failed: its text is the event's, its `state` what
    the attempt left behind, decided where it failed. A failed CSI call classifies its code there
    (controller_runtime.csi_errors); a failure before the driver was asked is FINISHED, or
    RESCHEDULE when the selected node cannot be used."""

    def __init__(self, message: str, state: OperationState = OperationState.FINISHED) -> None:
        super().__init__(message)
        self.state = state

    @property
    def final(self) -> bool:
        """The driver is certainly not still creating a volume for this attempt."""
        return self.state.final

    @property
    def reschedule(self) -> bool:
        """The scheduler is to pick another node: the selected-node annotation goes."""
        return self.state is OperationState.RESCHEDULE


def pv_name_for(prefix: str, claim: PersistentVolumeClaim) -> str:
    """`<prefix>-<claim UID>`: both the PV's name and CreateVolume's idempotency key."""
    return f"{prefix}-{claim['metadata']['uid']}"


def go_quote(text: str) -> str:
    """Go's %q for the strings these messages quote (JSON's escaping agrees for them)."""
    return json.dumps(text, ensure_ascii=False)


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


def _shell_name(s: str) -> tuple[str, int]:
    """The variable name after a `$` and how many characters it spans, as os.Expand reads it: an
    empty name with a width is bad syntax (eaten), with width 0 a lone `$` (kept)."""
    if s[0] == "{":
        if len(s) > 2 and s[1] in _SHELL_SPECIAL and s[2] == "}":
            return s[1], 3
        end = s.find("}", 1)
        if end == 1:
            return "", 2
        if end < 0:
            return "", 1
        return s[1:end], end + 1
    if s[0] in _SHELL_SPECIAL:
        return s[0], 1
    i = 0
    while i < len(s) and (s[i] == "_" or (s[i].isascii() and s[i].isalnum())):
        i += 1
    return s[:i], i


def expand_template(template: str, values: Mapping[str, str]) -> str:
    """`$name` / `${name}` substitution with os.Expand's syntax; every name must be known."""
    out: list[str] = []
    missing: set[str] = set()
    i = j = 0
    while j < len(template):
        if template[j] == "$" and j + 1 < len(template):
            out.append(template[i:j])
            name, width = _shell_name(template[j + 1 :])
            if name:
                if name not in values:
                    missing.add(name)
                out.append(values.get(name, ""))
            elif not width:
                out.append("$")
            j += width
            i = j + 1
        j += 1
    out.append(template[i:])
    if missing:
        raise ValueError(f"invalid tokens: [{' '.join(go_quote(m) for m in sorted(missing))}]")
    return "".join(out)


def _templates(kind: SecretKind, params: Mapping[str, str]) -> tuple[str, str]:
    """The (name, namespace) templates the class gives for one secret kind, ("", "") for none."""
    names_found = [
        params[k] for k in (f"{kind.deprecated}Name" if kind.deprecated else "", kind.name_key) if k in params
    ]
    namespaces_found = [
        params[k]
        for k in (f"{kind.deprecated}Namespace" if kind.deprecated else "", kind.namespace_key)
        if k in params
    ]
    if len(names_found) > 1 or len(namespaces_found) > 1:
        prefix = names.PARAMETER_PREFIX
        raise ValueError(f'{kind.title} secrets specified in parameters with both "csi" and "{prefix}" keys')
    if len(names_found) != len(namespaces_found):
        raise ValueError(
            f"either name and namespace for {kind.title} secrets specified, Both must be specified"
        )
    if not names_found:
        return "", ""
    if not names_found[0] or not namespaces_found[0]:
        raise ValueError(
            f"{kind.title} secrets specified in parameters but value of either namespace or name is empty"
        )
    return names_found[0], namespaces_found[0]


def _resolve(template: str, values: Mapping[str, str], limit: int, form: re.Pattern[str], what: str) -> str:
    try:
        value = expand_template(template, values)
    except ValueError as exc:
        raise ProvisionError(f"error resolving value {go_quote(template)}: {exc}") from exc
    if len(value) > limit or not form.match(value):
        resolved = f" resolved to {go_quote(value)} which" if value != template else ""
        raise ProvisionError(f"{go_quote(template)}{resolved} is not a valid {what}")
    return value


def secret_reference(
    kind: str,
    params: Mapping[str, str],
    pv_name: str,
    claim_namespace: str,
    claim_name: str,
    claim_annotations: Mapping[str, str],
) -> SecretRef | None:
    """The Secret a class names for one kind, templates resolved; None when it names none. The
    namespace may use only what the claim's author cannot choose (${pv.name}, ${pvc.namespace});
    the name may also use ${pvc.name} and ${pvc.annotations['key']}. Raises ProvisionError with
    the sidecar's messages."""
    try:
        name_t, ns_t = _templates(_BY_KIND[kind], params)
    except ValueError as exc:
        raise ProvisionError(f"failed to get name and namespace template from params: {exc}") from exc
    if not name_t and not ns_t:
        try:
            name_t, ns_t = _templates(_DEFAULT_SECRET, params)
        except ValueError as exc:
            raise ProvisionError(
                f"failed to get default name and namespace template from params: {exc}"
            ) from exc
    if not name_t and not ns_t:
        return None
    ns_values = {"pv.name": pv_name, "pvc.namespace": claim_namespace}
    namespace = _resolve(ns_t, ns_values, 63, _DNS1123_LABEL, "namespace name")
    name_values = {**ns_values, "pvc.name": claim_name}
    name_values.update({f"pvc.annotations['{k}']": v for k, v in claim_annotations.items()})
    name = _resolve(name_t, name_values, 253, _DNS1123_SUBDOMAIN, "secret name")
    return SecretRef(name=name, namespace=namespace)


def split_parameters(
    params: Mapping[str, str], claim: PersistentVolumeClaim, pv_name: str, default_fs: str
) -> ClassParameters:
    """Separates the class's parameters for the driver from the provisioner's own reserved keys,
    resolving every secret reference first (the sidecar's order, so its first error is ours).
    Unknown reserved keys are refused (a typo would otherwise silently drop a secret)."""
    md = claim["metadata"]
    secrets: dict[str, SecretRef] = {}
    for kind in SECRET_KINDS if not _SECRET_KEYS.isdisjoint(params) else ():
        ref = secret_reference(
            kind.kind, params, pv_name, md["namespace"], md["name"], md.get("annotations") or {}
        )
        if ref is not None:
            secrets[kind.kind] = ref
    unknown = sorted(k for k in params if k.startswith(names.PARAMETER_PREFIX) and k not in _KNOWN_RESERVED)
    if unknown:
        raise ProvisionError(
            "failed to strip CSI Parameters of prefixed keys: "
            f'found unknown parameter key "{unknown[0]}" with reserved namespace {names.PARAMETER_PREFIX}'
        )
    # The deprecated `fstype` key (any case) still counts, and still reaches the driver too.
    fs_keys = [k for k in params if k == names.PARAM_FSTYPE or k.lower() == "fstype"]
    if len(fs_keys) > 1:
        raise ProvisionError(
            f'fstype specified in parameters with both "fstype" and "{names.PARAM_FSTYPE}" keys'
        )
    fs_type = params[fs_keys[0]] if fs_keys else ""
    driver = {k: v for k, v in params.items() if not k.startswith(names.PARAMETER_PREFIX)}
    return ClassParameters(driver=driver, fs_type=fs_type or default_fs, secrets=secrets)


# -- topology --------------------------------------------------------------------------------------


def driver_topology_keys(csinode: CSINode | None, driver: str) -> list[str] | None:
    """The topology keys the node's plugin of `driver` reported, None when it has none there."""
    for d in (csinode or {}).get("spec", {}).get("drivers") or []:
        if d.get("name") == driver:
            return list(d.get("topologyKeys") or [])
    return None


def node_segment(node: Node, keys: Iterable[str]) -> Segment | None:
    labels = node.get("metadata", {}).get("labels") or {}
    keys = list(keys)
    if not keys or any(k not in labels for k in keys):
        return None
    return {k: labels[k] for k in keys}


def allowed_segments(allowed_topologies: list[TopologySelectorTerm]) -> list[Segment]:
    """A class's allowedTopologies as segments: each term is the product of its expressions' values."""
    out: list[Segment] = []
    # Deduplicated through a set: a membership test on the list made a class with a few hundred
    # values quadratic, and it runs on the event loop for every claim of the class.
    seen: set[frozenset[tuple[str, str]]] = set()
    for term in allowed_topologies:
        exprs = term.get("matchLabelExpressions") or []
        keys = [e["key"] for e in exprs]
        for values in itertools.product(*[e.get("values") or [] for e in exprs]):
            segment = dict(zip(keys, values, strict=True))
            identity = frozenset(segment.items())
            if segment and identity not in seen:
                seen.add(identity)
                out.append(segment)
    return out


def _covers(segment: Segment, other: Segment) -> bool:
    return all(other.get(k) == v for k, v in segment.items())


def _ordered(segments: list[Segment]) -> list[Segment]:
    return sorted(segments, key=lambda s: sorted(s.items()))


def _go_term(segment: Segment) -> str:
    """A segment as the Go sidecar prints its topologyTerm with %v: `[{key value} ...]`."""
    return "[" + " ".join(f"{{{k} {v}}}" for k, v in sorted(segment.items())) + "]"


def _go_map(labels: Mapping[str, str]) -> str:
    return "map[" + " ".join(f"{k}:{v}" for k, v in sorted(labels.items())) + "]"


_ACCESSIBILITY = "error generating accessibility requirements: "


@dataclass
class Topology:
    requisite: list[Segment]
    preferred: list[Segment]


def accessibility(
    driver: str,
    storage_class: StorageClass,
    pv_name: str,
    selected_node: Node | None,
    csinodes: Iterable[CSINode],
    nodes: Mapping[str, Node],
    *,
    strict: bool = False,
    immediate: bool = True,
) -> Topology | None:
    """CreateVolume's accessibility requirements, as the Go sidecar builds them (its README's
    topology table). Requisite: the class's allowedTopologies, else every segment a node of this
    driver reports. With a selected node (WaitForFirstConsumer, or an annotation the claim's author
    wrote) the preferred segments are the requisite ones rotated to start at the first that the
    node's segment falls in, so a driver that honours preference places the volume where the pod
    goes; a node outside every allowed segment is an error, never a reason to ask for its segment
    (the annotation is the user's to write, allowedTopologies the admin's). With `strict`
    (--strict-topology) a selected node's segment is the only requisite and preferred one. Without
    a selected node, preference is rotated by the volume's name so volumes spread over the
    segments, and with neither allowedTopologies nor `immediate` (--immediate-topology=false) no
    requirement is sent at all. Raises ProvisionError with the sidecar's messages; a missing
    CSINode asks the scheduler for another node, as upstream."""
    selected: Segment | None = None
    node_name = ""
    if selected_node is not None:
        node_name = selected_node["metadata"]["name"]
        csinode = next((c for c in csinodes if c["metadata"]["name"] == node_name), None)
        if csinode is None:
            raise ProvisionError(
                f'failed to get selected CSINode {node_name}: csinode.storage.k8s.io "{node_name}" not found',
                OperationState.RESCHEDULE,
            )
        keys = driver_topology_keys(csinode, driver)
        if not keys:
            raise ProvisionError(f"{_ACCESSIBILITY}no topology key found for node {node_name}")
        selected = node_segment(selected_node, keys)
        if selected is None:
            labels = selected_node.get("metadata", {}).get("labels") or {}
            raise ProvisionError(
                f"{_ACCESSIBILITY}topology labels from selected node {_go_map(labels)} does not match "
                f"topology keys from CSINode [{' '.join(keys)}]"
            )
    allowed = storage_class.get("allowedTopologies") or []
    if selected is not None and strict:
        return _strict(selected, node_name, allowed_segments(allowed))
    if allowed:
        requisite = allowed_segments(allowed)
    elif selected is None and not immediate:
        return None  # neither the claim nor the class limits where: the driver decides
    else:
        seen: list[Segment] = []
        known: set[frozenset[tuple[str, str]]] = set()  # a list membership test was quadratic in nodes
        for c in csinodes:
            keys = driver_topology_keys(c, driver)
            node = nodes.get(c["metadata"]["name"])
            segment = node_segment(node, keys) if node is not None and keys else None
            if segment is not None and frozenset(segment.items()) not in known:
                known.add(frozenset(segment.items()))
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
        at = next((i for i, s in enumerate(requisite) if _covers(s, selected)), None)
        if at is None:
            raise ProvisionError(
                f"{_ACCESSIBILITY}topology {_go_term(selected)} from selected node {go_quote(node_name)} "
                f"is not in requisite: [{' '.join(_go_term(s) for s in requisite)}]"
            )
        preferred = requisite[at:] + requisite[:at]
    else:
        shift = zlib.crc32(pv_name.encode()) % len(requisite)
        preferred = requisite[shift:] + requisite[:shift]
    return Topology(requisite=requisite, preferred=preferred)


def _strict(selected: Segment, node_name: str, allowed: list[Segment]) -> Topology:
    """--strict-topology with a selected node: its segment alone, which the class must allow."""
    if allowed and not any(_covers(s, selected) for s in allowed):
        raise ProvisionError(
            f"{_ACCESSIBILITY}selected node '{go_quote(node_name)}' topology '{_go_term(selected)}' "
            f"is not in allowed topologies: [{' '.join(_go_term(s) for s in allowed)}]"
        )
    return Topology(requisite=[dict(selected)], preferred=[dict(selected)])


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
    # The claim's VolumeAttributesClass's parameters, sent as CreateVolume's mutable_parameters.
    mutable_parameters: dict[str, str] = field(default_factory=dict)

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
            mutable_parameters=self.mutable_parameters,
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


def is_block(claim: PersistentVolumeClaim) -> bool:
    return bool(claim.get("spec", {}).get("volumeMode") == "Block")


def volume_spec(
    claim: PersistentVolumeClaim,
    storage_class: StorageClass,
    params: ClassParameters,
    pv_name: str,
    *,
    extra_metadata: bool,
    multi_writer: bool,
    topology: Topology | None,
    source_volume: str = "",
    source_snapshot: str = "",
    mode_change_granted: bool = False,
    mutable_parameters: Mapping[str, str] | None = None,
) -> VolumeSpec:
    """The CreateVolume request for a claim. `mode_change_granted` (a restore whose
    VolumeSnapshotContent allows another volume mode) adds the grant to the driver's parameters
    under the annotation's own key: kubeloop's extension, for a driver that refuses a mode change
    it is not told about (docs/contracts.md)."""
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
    if mode_change_granted:
        driver_params[storage.ANN_ALLOW_VOLUME_MODE_CHANGE] = "true"
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
        mutable_parameters=dict(mutable_parameters or {}),
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
    claim: PersistentVolumeClaim,
    storage_class: StorageClass,
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
    # DeleteVolume gets the provisioner's secret from these, not from the class, which may have
    # changed or gone by then and cannot resolve ${pvc.annotations[...]} without the claim. Empty
    # values record that no secret is needed.
    deletion = params.secrets.get("provisioner")
    annotations = {
        storage.ANN_PROVISIONED_BY: driver,
        names.ANN_DELETION_SECRET_NAME: deletion.name if deletion else "",
        names.ANN_DELETION_SECRET_NAMESPACE: deletion.namespace if deletion else "",
    }
    modify = params.secrets.get("controller-modify")
    if modify is not None:
        annotations[names.ANN_MODIFY_SECRET_NAME] = modify.name
        annotations[names.ANN_MODIFY_SECRET_NAMESPACE] = modify.namespace
    metadata: Obj = {"name": spec.name, "annotations": annotations}
    if policy == storage.DELETE:
        metadata["finalizers"] = [names.PV_FINALIZER]
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": metadata, "spec": pv_spec}
