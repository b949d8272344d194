"""The driver's whole CSI surface, RPC by RPC, against the CSI spec (spec.md, v1.12): every MUST
and every error-table row of the Identity, Controller and Node RPCs the driver implements, plus
hostile inputs (control characters, huge strings, negative sizes, paths outside the kubelet
directory, concurrent calls on one name). Each test names the rule it checks.

Most tests share one `--mode all` driver (module scope, unique names per test); those that need
their own flags, a restart or a tampered pool start their own. Every non-OK status is checked
against the spec's error scheme as well: a human-readable message, and no status details.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest

from csi_driver import DRIVER_NAME, TOPOLOGY_KEY
from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc

from .conftest import Client, Driver, loop_devices_under, stop_and_clean
from .volumes import MiB, Mode, block_cap, mount_cap

pytestmark = pytest.mark.root

Code = grpc.StatusCode
INVALID = Code.INVALID_ARGUMENT
NOT_FOUND = Code.NOT_FOUND
ALREADY_EXISTS = Code.ALREADY_EXISTS
PRECONDITION = Code.FAILED_PRECONDITION
OUT_OF_RANGE = Code.OUT_OF_RANGE
EXHAUSTED = Code.RESOURCE_EXHAUSTED
ABORTED = Code.ABORTED
UNIMPLEMENTED = Code.UNIMPLEMENTED

SIZE = 16 * MiB
SECRET_KEY = "kubeloop-test-secret"
CapRPC = csi_pb2.ControllerServiceCapability.RPC
NodeRPC = csi_pb2.NodeServiceCapability.RPC
PluginService = csi_pb2.PluginCapability.Service
Unit = csi_pb2.VolumeUsage.Unit

_seq = itertools.count(1)


def uniq(prefix: str) -> str:
    return f"{prefix}-{next(_seq)}"


# --- the error scheme -----------------------------------------------------------------------------
def fails(codes: Any, call: Callable[[], object], what: str = "") -> Any:
    """Runs `call`, which must fail with one of `codes`. Error scheme: a non-OK status MUST carry a
    human-readable message and its details MUST be empty. Returns the error."""
    wanted = tuple(codes) if isinstance(codes, tuple | list | set) else (codes,)
    expected = " or ".join(c.name for c in wanted)
    try:
        call()
    except grpc.RpcError as e:
        err = e
    else:
        pytest.fail(f"{what + ': ' if what else ''}expected {expected}, got OK")
    got = err.code()
    assert got in wanted, (
        f"{what + ': ' if what else ''}expected {expected}, got {got.name}: {err.details()!r}"
    )
    assert (err.details() or "").strip(), f"{got.name} without a human-readable message"
    keys = [k for k, _ in (err.trailing_metadata() or ())]
    assert "grpc-status-details-bin" not in keys, "status details MUST be empty"
    return err


# --- fixtures -------------------------------------------------------------------------------------
def announce(d: Driver, node_id: str, max_volumes: int = 0) -> None:
    """Every node plugin announces itself in the pool at start (docs/csi-driver.md, state layout);
    a hand-written announcement stands in for a second node plugin sharing the pool."""
    path = d.pool / "nodes" / f"{node_id}.json"
    path.write_text(json.dumps({"node_id": node_id, "max_volumes_per_node": max_volumes}))


@pytest.fixture(scope="module")
def shared(csi_root: Path) -> Iterator[Driver]:
    work = Path(tempfile.mkdtemp(prefix="se", dir=csi_root))
    d = Driver(work, "all", "node-a").start()
    announce(d, "node-b")
    try:
        yield d
    finally:
        stop_and_clean(d, work)


@pytest.fixture(scope="module")
def sc(shared: Driver) -> Iterator[Client]:
    c = Client(shared.endpoint)
    yield c
    c.close()


@contextlib.contextmanager
def own_driver(csi_root: Path, *extra: str, mode: str = "all") -> Iterator[tuple[Driver, Client]]:
    """A driver with its own flags, directories and client, stopped and cleaned up afterwards."""
    work = Path(tempfile.mkdtemp(prefix="so", dir=csi_root))
    d = Driver(work, mode, "node-a", list(extra)).start()
    c = Client(d.endpoint)
    try:
        yield d, c
    finally:
        c.close()
        stop_and_clean(d, work)


# --- request helpers ------------------------------------------------------------------------------
def create(
    client: Client,
    name: str | None = None,
    size: int = SIZE,
    limit: int = 0,
    cap: csi_pb2.VolumeCapability | None = None,
    **kwargs: object,
) -> csi_pb2.Volume:
    """CreateVolume; without a size or a limit the request carries no capacity_range at all."""
    req = csi_pb2.CreateVolumeRequest(
        name=name if name is not None else uniq("vol"),
        volume_capabilities=[cap or mount_cap()],
        **kwargs,
    )
    if size or limit:
        req.capacity_range.CopyFrom(csi_pb2.CapacityRange(required_bytes=size, limit_bytes=limit))
    return client.controller.CreateVolume(req).volume


def snapshot(client: Client, volume_id: str, name: str | None = None) -> csi_pb2.Snapshot:
    req = csi_pb2.CreateSnapshotRequest(name=name or uniq("snap"), source_volume_id=volume_id)
    return client.controller.CreateSnapshot(req).snapshot


def from_snapshot(snapshot_id: str) -> csi_pb2.VolumeContentSource:
    return csi_pb2.VolumeContentSource(
        snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snapshot_id)
    )


def from_volume(volume_id: str) -> csi_pb2.VolumeContentSource:
    return csi_pb2.VolumeContentSource(volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=volume_id))


def topology(*nodes: str) -> list[csi_pb2.Topology]:
    return [csi_pb2.Topology(segments={TOPOLOGY_KEY: n}) for n in nodes]


def controller_publish(
    client: Client, volume_id: str, node_id: str, cap: csi_pb2.VolumeCapability, readonly: bool = False
) -> dict[str, str]:
    rsp = client.controller.ControllerPublishVolume(
        csi_pb2.ControllerPublishVolumeRequest(
            volume_id=volume_id, node_id=node_id, volume_capability=cap, readonly=readonly
        )
    )
    return dict(rsp.publish_context)


def controller_unpublish(client: Client, volume_id: str, node_id: str = "") -> None:
    client.controller.ControllerUnpublishVolume(
        csi_pb2.ControllerUnpublishVolumeRequest(volume_id=volume_id, node_id=node_id)
    )


def stage(client: Client, volume_id: str, staging: str, cap: csi_pb2.VolumeCapability, **kw: object) -> None:
    os.makedirs(staging, exist_ok=True)  # the CO creates the staging directory
    client.node.NodeStageVolume(
        csi_pb2.NodeStageVolumeRequest(
            volume_id=volume_id, staging_target_path=staging, volume_capability=cap, **kw
        )
    )


def unstage(client: Client, volume_id: str, staging: str) -> None:
    client.node.NodeUnstageVolume(
        csi_pb2.NodeUnstageVolumeRequest(volume_id=volume_id, staging_target_path=staging)
    )


def publish(
    client: Client,
    volume_id: str,
    staging: str,
    target: str,
    cap: csi_pb2.VolumeCapability,
    readonly: bool = False,
    **kw: object,
) -> None:
    client.node.NodePublishVolume(
        csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id,
            staging_target_path=staging,
            target_path=target,
            volume_capability=cap,
            readonly=readonly,
            **kw,
        )
    )


def unpublish(client: Client, volume_id: str, target: str) -> None:
    client.node.NodeUnpublishVolume(
        csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=target)
    )


@contextlib.contextmanager
def staged(
    client: Client, d: Driver, volume_id: str, cap: csi_pb2.VolumeCapability, **kw: object
) -> Iterator[str]:
    """Stages a volume at a fresh path under the kubelet directory; on exit unpublishes whatever
    the driver still has published of it (see conftest.teardown_volumes) and unstages it."""
    path = str(d.kubelet / uniq("staging"))
    stage(client, volume_id, path, cap, **kw)
    try:
        yield path
    finally:
        record = d.state / "staging" / f"{volume_id}.json"
        if record.exists():
            for target in json.loads(record.read_text()).get("targets", {}):
                unpublish(client, volume_id, target)
        unstage(client, volume_id, path)


@contextlib.contextmanager
def staged_or_error(client: Client, d: Driver, volume_id: str, cap: Any, **kw: object) -> Iterator[Any]:
    """Tries to stage; yields the gRPC error (None on success) and unstages whatever happened."""
    path = str(d.kubelet / uniq("staging"))
    error = None
    try:
        stage(client, volume_id, path, cap, **kw)
    except grpc.RpcError as e:
        error = e
    try:
        yield error
    finally:
        unstage(client, volume_id, path)


def backing_file(d: Driver, volume_id: str) -> Path:
    return d.pool / "volumes" / f"{volume_id}.img"


def list_all_volumes(client: Client, page: int = 0) -> list[Any]:
    entries: list[Any] = []
    token = ""
    while True:
        rsp = client.controller.ListVolumes(
            csi_pb2.ListVolumesRequest(max_entries=page, starting_token=token)
        )
        if page:
            assert len(rsp.entries) <= page, "more entries than max_entries"
        entries.extend(rsp.entries)
        token = rsp.next_token
        if not token:
            return entries


def target_path(d: Driver) -> str:
    return str(d.kubelet / uniq("pods") / "volume")


# ==================================================================================================
# Identity
# ==================================================================================================
def test_get_plugin_info_name_and_vendor_version(sc: Client) -> None:
    """GetPluginInfo: name is REQUIRED, domain-name notation, at most 63 characters, alphanumeric at
    both ends with dashes, dots and alphanumerics between; vendor_version is REQUIRED."""
    info = sc.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert info.name == DRIVER_NAME
    assert re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,61}[A-Za-z0-9])?", info.name), info.name
    assert info.vendor_version


def test_plugin_capabilities_are_the_same_whichever_services_an_instance_serves(
    csi_root: Path, sc: Client
) -> None:
    """GetPluginCapabilities: every instance of one version SHALL return the same set, whatever RPCs
    that instance serves (a node-mode plugin reports what the plugin as a whole can do)."""

    def caps(client: Client) -> set[str]:
        rsp = client.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest())
        return {str(c).replace("\n", " ").strip() for c in rsp.capabilities}

    everything = caps(sc)
    with own_driver(csi_root, mode="node") as (_, node_client):
        assert caps(node_client) == everything


def test_probe_reports_ready(sc: Client) -> None:
    """Probe: a plugin that has finished initializing answers OK with ready true."""
    assert sc.identity.Probe(csi_pb2.ProbeRequest()).ready.value is True


def test_probe_fails_precondition_when_the_pool_is_gone(csi_root: Path) -> None:
    """Probe errors: a plugin that is not healthy MUST answer FAILED_PRECONDITION; one whose pool
    directory vanished cannot serve a single volume."""
    with own_driver(csi_root) as (d, client):
        moved = d.pool.with_name("pool-moved")
        d.pool.rename(moved)
        try:
            fails(PRECONDITION, lambda: client.identity.Probe(csi_pb2.ProbeRequest()))
        finally:
            moved.rename(d.pool)


def test_controller_capabilities_and_the_services_offered(sc: Client) -> None:
    """ControllerGetCapabilities: LIST_VOLUMES_PUBLISHED_NODES requires PUBLISH_UNPUBLISH_VOLUME;
    MODIFY_VOLUME is advertised and served (an unknown key is INVALID_ARGUMENT, not UNIMPLEMENTED);
    the plugin says it has a group controller and a SnapshotMetadata service, and both answer."""
    rsp = sc.controller.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest())
    caps = {c.rpc.type for c in rsp.capabilities}
    assert CapRPC.LIST_VOLUMES_PUBLISHED_NODES not in caps or CapRPC.PUBLISH_UNPUBLISH_VOLUME in caps
    assert CapRPC.MODIFY_VOLUME in caps
    fails(
        INVALID,
        lambda: sc.controller.ControllerModifyVolume(
            csi_pb2.ControllerModifyVolumeRequest(volume_id="vol-x", mutable_parameters={"a": "b"})
        ),
    )
    plugin = sc.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest())
    services = {c.service.type for c in plugin.capabilities}
    assert {PluginService.GROUP_CONTROLLER_SERVICE, PluginService.SNAPSHOT_METADATA_SERVICE} <= services
    group = csi_pb2_grpc.GroupControllerStub(sc.channel)
    got = group.GroupControllerGetCapabilities(csi_pb2.GroupControllerGetCapabilitiesRequest())
    assert [c.rpc.type for c in got.capabilities] == [
        csi_pb2.GroupControllerServiceCapability.RPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT
    ]


# ==================================================================================================
# CreateVolume
# ==================================================================================================
def _no_mode_cap() -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume())


def _leave_out(kwargs: dict[str, Any], missing: str) -> None:
    """Drops the field a test leaves out; "access_mode" keeps the capability but drops its mode."""
    if missing == "access_mode":
        kwargs["volume_capability"] = _no_mode_cap()
    else:
        del kwargs[missing]


def _no_type_cap() -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(
        access_mode=csi_pb2.VolumeCapability.AccessMode(mode=Mode.SINGLE_NODE_WRITER)
    )


@pytest.mark.parametrize(
    "request_kwargs",
    [
        {"volume_capabilities": [mount_cap()]},  # no name
        {"name": "no-capabilities"},
        {"name": "no-access-mode", "volume_capabilities": [_no_mode_cap()]},
        {"name": "no-access-type", "volume_capabilities": [_no_type_cap()]},
        {"name": "mode-unknown", "volume_capabilities": [mount_cap(mode=Mode.UNKNOWN)]},
    ],
    ids=["no-name", "no-capabilities", "no-access-mode", "no-access-type", "mode-unknown"],
)
def test_create_volume_missing_required_fields(sc: Client, request_kwargs: dict[str, Any]) -> None:
    """CreateVolume: name and volume_capabilities are REQUIRED, and so are a capability's access
    type and access mode; a missing required field is INVALID_ARGUMENT."""
    fails(INVALID, lambda: sc.controller.CreateVolume(csi_pb2.CreateVolumeRequest(**request_kwargs)))


BANNED = [
    "\x00",
    "\x01",
    "\x07",
    "\x08",
    "\x0b",
    "\x0c",
    "\x0e",
    "\x1b",
    "\x1f",
    "\x7f",
    "\x80",
    "\x85",
    "\x9f",
]


@pytest.mark.parametrize("rpc", ["CreateVolume", "CreateSnapshot"])
@pytest.mark.parametrize("char", BANNED, ids=[f"U+{ord(c):04X}" for c in BANNED])
def test_names_with_banned_control_characters_are_invalid(sc: Client, rpc: str, char: str) -> None:
    """CreateVolume/CreateSnapshot name: any Unicode string is allowed except those holding
    U+0000-U+0008, U+000B, U+000C, U+000E-U+001F or U+007F-U+009F; such a name is an invalid
    field, INVALID_ARGUMENT."""
    name = f"bad{char}name"
    if rpc == "CreateVolume":
        fails(INVALID, lambda: create(sc, name))
    else:
        source = create(sc).volume_id
        fails(INVALID, lambda: snapshot(sc, source, name))


@pytest.mark.parametrize(
    "name",
    [
        "tab\tnewline\nreturn\r",
        "with spaces",
        "unicode-é-日本語-🚀",
        "../../../etc/passwd",
        "/absolute/looking",
        "x" * 128,
        "é" * 64,  # 128 bytes
    ],
    ids=["whitespace", "spaces", "unicode", "dotdot", "slashes", "128-ascii", "128-bytes-utf8"],
)
def test_any_other_unicode_name_up_to_128_bytes_is_accepted(sc: Client, shared: Driver, name: str) -> None:
    """CreateVolume/CreateSnapshot name: every other Unicode string within the 128-byte string limit
    is allowed (names are opaque to the plugin, never a path), and a repeat is idempotent."""
    vol = create(sc, name)
    assert create(sc, name).volume_id == vol.volume_id
    snap = snapshot(sc, vol.volume_id, name)
    assert snapshot(sc, vol.volume_id, name).snapshot_id == snap.snapshot_id
    assert {p.name for p in shared.pool.iterdir()} <= {
        ".budget.lock",
        ".controller.lock",
        "budget.json",
        "nodes",
        "snapshots",
        "volumes",
        "ephemeral",
        "freezes",
    }
    assert all(re.fullmatch(r"vol-[0-9a-f]{32}\.img", p.name) for p in (shared.pool / "volumes").iterdir())
    assert not (shared.root / "etc").exists() and not (shared.pool / "etc").exists()


@pytest.mark.parametrize(
    ("required", "limit", "code"),
    [
        (-1, 0, INVALID),
        (0, -1, INVALID),
        (-(1 << 63), -(1 << 63), INVALID),
        (32 * MiB, 16 * MiB, OUT_OF_RANGE),
        ((1 << 63) - 1, 0, OUT_OF_RANGE),
        (0, 1000, OUT_OF_RANGE),  # below the smallest size the driver makes (4 KiB)
        (4 << 40, 0, OUT_OF_RANGE),  # above --max-volume-size (1 TiB)
    ],
    ids=[
        "negative-required",
        "negative-limit",
        "int64-min",
        "required-above-limit",
        "int64-max",
        "tiny",
        "4TiB",
    ],
)
def test_create_volume_unsupported_capacity_range(sc: Client, required: int, limit: int, code: Any) -> None:
    """CapacityRange: required_bytes and limit_bytes MUST NOT be negative (an invalid field,
    INVALID_ARGUMENT); a range the plugin cannot give is OUT_OF_RANGE."""
    fails(code, lambda: create(sc, size=required, limit=limit))


def test_create_volume_capacity_range_with_neither_bound_is_invalid(sc: Client) -> None:
    """CapacityRange: at least one of required_bytes and limit_bytes MUST be specified; a
    capacity_range that sets neither is an invalid field, INVALID_ARGUMENT."""
    req = csi_pb2.CreateVolumeRequest(
        name=uniq("empty-range"), capacity_range=csi_pb2.CapacityRange(), volume_capabilities=[mount_cap()]
    )
    assert req.HasField("capacity_range")
    fails(INVALID, lambda: sc.controller.CreateVolume(req))


@pytest.mark.parametrize(
    ("required", "limit"),
    [(5 * MiB + 1, 6 * MiB), (0, 3 * MiB + 5), (7 * MiB, 7 * MiB), (1, 4096), (3 * MiB + 1, 3 * MiB + 4096)],
)
def test_create_volume_honours_capacity_range(sc: Client, required: int, limit: int) -> None:
    """CreateVolume capacity_range: if specified it MUST always be honoured: the volume is at least
    required_bytes and not bigger than limit_bytes (an exact size when both are equal)."""
    vol = create(sc, size=required, limit=limit)
    assert required <= vol.capacity_bytes and (not limit or vol.capacity_bytes <= limit), vol.capacity_bytes


def test_create_volume_is_idempotent_and_incompatible_repeats_already_exist(sc: Client) -> None:
    """CreateVolume MUST be idempotent: a repeat of a compatible request answers OK with the same
    volume; a volume of that name that is incompatible with the capacity_range, capabilities,
    parameters or content source is ALREADY_EXISTS."""
    name = uniq("idem")
    vol = create(sc, name, size=SIZE, parameters={"csi.storage.k8s.io/fstype": "ext4"})
    again = create(sc, name, size=SIZE, parameters={"csi.storage.k8s.io/fstype": "ext4"})
    assert again.volume_id == vol.volume_id and again.capacity_bytes == vol.capacity_bytes
    assert dict(again.volume_context) == dict(vol.volume_context)
    source = snapshot(sc, create(sc).volume_id)
    incompatible: dict[str, Callable[[], object]] = {
        "larger": lambda: create(sc, name, size=4 * SIZE),
        "smaller limit": lambda: create(sc, name, size=MiB, limit=2 * MiB),
        "block": lambda: create(sc, name, cap=block_cap()),
        "xfs": lambda: create(sc, name, parameters={"csi.storage.k8s.io/fstype": "xfs"}),
        "source": lambda: create(sc, name, volume_content_source=from_snapshot(source.snapshot_id)),
    }
    for what, call in incompatible.items():
        fails(ALREADY_EXISTS, call, what)


def test_create_volume_same_name_not_accessible_from_requested_topology_already_exists(sc: Client) -> None:
    """CreateVolume: a repeat answers OK only if the existing volume is accessible from the
    accessibility_requirements; one incompatible with them is ALREADY_EXISTS."""
    name = uniq("topo")
    vol = create(
        sc,
        name,
        accessibility_requirements=csi_pb2.TopologyRequirement(
            requisite=topology("node-a"), preferred=topology("node-a")
        ),
    )
    assert [dict(t.segments) for t in vol.accessible_topology] == [{TOPOLOGY_KEY: "node-a"}]
    fails(
        ALREADY_EXISTS,
        lambda: create(
            sc,
            name,
            accessibility_requirements=csi_pb2.TopologyRequirement(
                requisite=topology("node-b"), preferred=topology("node-b")
            ),
        ),
    )


@pytest.mark.parametrize(
    "requirement",
    [
        csi_pb2.TopologyRequirement(),
        csi_pb2.TopologyRequirement(requisite=topology("node-a"), preferred=topology("node-b")),
    ],
    ids=["neither-requisite-nor-preferred", "preferred-not-in-requisite"],
)
def test_create_volume_malformed_topology_requirement_is_invalid(sc: Client, requirement: Any) -> None:
    """TopologyRequirement: when given, requisite or preferred or both MUST be specified, and every
    preferred topology MUST also be in the requisite list; a request breaking that is
    INVALID_ARGUMENT."""
    fails(INVALID, lambda: create(sc, accessibility_requirements=requirement))


def test_create_volume_topology_within_requisite_or_resource_exhausted(sc: Client) -> None:
    """TopologyRequirement: the volume MUST be accessible from at least one requisite topology and
    only from those the SP chose among them; a requisite it cannot provision in is
    RESOURCE_EXHAUSTED (unable to provision in the accessible topology)."""
    requisite = topology("node-a", "node-b")
    vol = create(sc, accessibility_requirements=csi_pb2.TopologyRequirement(requisite=requisite))
    chosen = [dict(t.segments) for t in vol.accessible_topology]
    assert chosen and all(c in [dict(r.segments) for r in requisite] for c in chosen), chosen
    foreign = [csi_pb2.Topology(segments={"topology.example.com/zone": "z1"})]
    fails(
        EXHAUSTED,
        lambda: create(sc, accessibility_requirements=csi_pb2.TopologyRequirement(requisite=foreign)),
    )


def _cap_with_flag(flag: str) -> csi_pb2.VolumeCapability:
    cap = mount_cap()
    cap.mount.mount_flags.append(flag)
    return cap


@pytest.mark.parametrize(
    "kwargs",
    [
        {"volume_capabilities": [mount_cap(), mount_cap("ntfs")]},
        {"volume_capabilities": [mount_cap(mode=Mode.MULTI_NODE_MULTI_WRITER)]},
        {"volume_capabilities": [mount_cap(), block_cap()]},
        {"volume_capabilities": [mount_cap("ext4\x00")]},
        {"volume_capabilities": [mount_cap("../ext4")]},
        {"volume_capabilities": [mount_cap("x" * 300)]},
        {"volume_capabilities": [_cap_with_flag("loop")]},
        {"volume_capabilities": [_cap_with_flag("noatime\nbind")]},
        {"volume_capabilities": [mount_cap()], "parameters": {"csi.storage.k8s.io/fstype": "ntfs"}},
        {"volume_capabilities": [mount_cap()], "parameters": {"no-such-parameter": "1"}},
        {"volume_capabilities": [mount_cap("xfs")], "parameters": {"fsType": "ext4"}},
    ],
    ids=[
        "one-unsupported-fs",
        "multi-writer-filesystem",
        "mount-and-block",
        "fs-with-nul",
        "fs-path",
        "fs-300",
        "forbidden-mount-option",
        "mount-flag-newline",
        "unsupported-fs-parameter",
        "unknown-parameter",
        "conflicting-fs",
    ],
)
def test_create_volume_unsupported_capabilities_or_parameters(sc: Client, kwargs: dict[str, Any]) -> None:
    """CreateVolume volume_capabilities: the SP MUST provision a volume satisfying ALL of them; if
    ANY is unsupported the call MUST fail (an unsupported field: INVALID_ARGUMENT), and so do
    parameters the plugin cannot honour."""
    req = csi_pb2.CreateVolumeRequest(
        name=uniq("unsupported"), capacity_range=csi_pb2.CapacityRange(required_bytes=SIZE), **kwargs
    )
    fails(INVALID, lambda: sc.controller.CreateVolume(req))


def test_create_volume_source_not_found_or_incompatible(sc: Client) -> None:
    """CreateVolume errors: a source snapshot or volume that does not exist is NOT_FOUND; a
    VolumeContentSource MUST name one of its types, else INVALID_ARGUMENT."""
    vol = create(sc)
    snap = snapshot(sc, vol.volume_id)
    for source in (
        from_snapshot("snap-does-not-exist"),
        from_volume("vol-does-not-exist"),
        from_snapshot(vol.volume_id),  # a volume id is no snapshot id
        from_volume(snap.snapshot_id),  # nor the other way round
    ):
        fails(NOT_FOUND, partial(create, sc, volume_content_source=source))
    fails(INVALID, lambda: create(sc, volume_content_source=csi_pb2.VolumeContentSource()))


@pytest.mark.parametrize("kind", ["snapshot", "volume"])
def test_create_volume_from_source_honours_capacity(sc: Client, kind: str) -> None:
    """CreateVolume from a source: a volume MUST NOT be smaller than its source snapshot (or cloned
    volume), OUT_OF_RANGE otherwise; a larger one is either refused OUT_OF_RANGE or has the
    requested size; the response names its content source."""
    src = create(sc, size=SIZE)
    source = (
        from_snapshot(snapshot(sc, src.volume_id).snapshot_id)
        if kind == "snapshot"
        else from_volume(src.volume_id)
    )
    fails(OUT_OF_RANGE, lambda: create(sc, size=SIZE // 2, volume_content_source=source))
    fails(OUT_OF_RANGE, lambda: create(sc, size=0, limit=SIZE // 2, volume_content_source=source))
    same = create(sc, size=0, volume_content_source=source)
    assert same.capacity_bytes >= SIZE and same.content_source == source
    try:
        larger = create(sc, size=2 * SIZE, volume_content_source=source)
    except grpc.RpcError as e:
        assert e.code() == OUT_OF_RANGE, e
    else:
        assert larger.capacity_bytes >= 2 * SIZE and larger.content_source == source


@pytest.mark.parametrize(
    ("source_cap", "new_cap"),
    [(mount_cap("ext4"), mount_cap("xfs")), (block_cap(), mount_cap())],
    ids=["ext4-restored-as-xfs", "block-restored-as-filesystem"],
)
@pytest.mark.parametrize("kind", ["snapshot", "volume"])
def test_create_volume_from_an_incompatible_source_is_invalid(
    sc: Client, kind: str, source_cap: Any, new_cap: Any
) -> None:
    """CreateVolume errors: a source the new volume's parameters are incompatible with (a filesystem
    of another type, raw block data under a filesystem capability) is INVALID_ARGUMENT."""
    src = create(sc, cap=source_cap)
    if kind == "snapshot":
        source = from_snapshot(snapshot(sc, src.volume_id).snapshot_id)
    else:
        source = from_volume(src.volume_id)
    fails(INVALID, lambda: create(sc, cap=new_cap, volume_content_source=source))


def test_create_volume_name_that_is_not_utf8_is_invalid(sc: Client) -> None:
    """Error scheme: a request whose string field is not UTF-8 is not a valid message: an invalid
    field (INVALID_ARGUMENT), never UNKNOWN."""
    token = "NONUTF8TOKEN"
    raw = csi_pb2.CreateVolumeRequest(name=token, volume_capabilities=[mount_cap()]).SerializeToString()
    raw = raw.replace(token.encode(), b"\xff\xfe\xc3(\xa0\xa1\xe2(\xa1\xf0\x80\x80")
    call = sc.channel.unary_unary(
        "/csi.v1.Controller/CreateVolume",
        request_serializer=lambda b: b,
        response_deserializer=csi_pb2.CreateVolumeResponse.FromString,
    )
    fails(INVALID, lambda: call(raw, timeout=10))


def test_create_volume_huge_strings(sc: Client) -> None:
    """Field size limits: strings are limited to 128 bytes and maps to 4 KiB; a 1 MiB name is an
    invalid field (INVALID_ARGUMENT); an oversized ignored parameter fails cleanly or is ignored,
    never UNKNOWN or INTERNAL."""
    fails(INVALID, lambda: create(sc, "n" * MiB))
    fails(INVALID, lambda: snapshot(sc, create(sc).volume_id, "n" * MiB))
    try:
        create(sc, parameters={"csi.storage.k8s.io/pvc/name": "p" * MiB})
    except grpc.RpcError as e:
        assert e.code() == INVALID, e


HUGE = 64 * 1024


def _huge_request(case: str, client: Client, d: Driver) -> Callable[[], object]:
    cv = client.controller
    kubelet = str(d.kubelet)

    def create_with(**kwargs: Any) -> Callable[[], object]:
        kwargs.setdefault("volume_capabilities", [mount_cap()])
        return partial(cv.CreateVolume, csi_pb2.CreateVolumeRequest(name=uniq("huge"), **kwargs))

    if case == "fs_type":
        return create_with(volume_capabilities=[mount_cap("x" * HUGE)])
    if case == "mount_flag":
        return create_with(volume_capabilities=[_cap_with_flag("x-" + "y" * HUGE)])
    if case == "parameter_key":
        return create_with(parameters={"k" * HUGE: "v"})
    if case == "parameter_value":
        return create_with(parameters={"fsType": "z" * HUGE})
    if case == "snapshot_parameter":
        source = create(client).volume_id
        req = csi_pb2.CreateSnapshotRequest(
            name=uniq("s"), source_volume_id=source, parameters={"k" * HUGE: "v"}
        )
        return partial(cv.CreateSnapshot, req)
    if case == "node_id":
        return partial(controller_publish, client, create(client).volume_id, "n" * HUGE, mount_cap())
    if case == "staging_path":
        req = csi_pb2.NodeStageVolumeRequest(
            volume_id=create(client).volume_id, staging_target_path="r" * HUGE, volume_capability=mount_cap()
        )
        return partial(client.node.NodeStageVolume, req)
    if case == "target_path":
        return partial(publish, client, "vol-x", f"{kubelet}/staging", "t" * HUGE, mount_cap())
    if case == "backing_file_hint":
        req = csi_pb2.NodeStageVolumeRequest(
            volume_id=create(client).volume_id,
            staging_target_path=f"{kubelet}/{uniq('staging')}",
            volume_capability=mount_cap(),
            publish_context={"loop.csi.kubeloop.dev/backing-file": "h" * HUGE},
        )
        return partial(client.node.NodeStageVolume, req)
    raise AssertionError(case)


HUGE_CASES = {
    "fs_type": INVALID,
    "mount_flag": INVALID,
    "parameter_key": INVALID,
    "parameter_value": INVALID,
    "snapshot_parameter": INVALID,
    "node_id": (NOT_FOUND, INVALID),
    "staging_path": INVALID,
    "target_path": INVALID,
    "backing_file_hint": (PRECONDITION, INVALID),
}


@pytest.mark.parametrize("case", list(HUGE_CASES))
def test_huge_values_get_their_own_status_code(sc: Client, shared: Driver, case: str) -> None:
    """Error scheme: the status code MUST be the one the condition calls for, with a human-readable
    message. A 64 KiB value (far beyond the 128-byte string and 4 KiB map limits) is refused with
    that code; a message echoing the whole value exceeds gRPC's metadata limits, and the CO gets
    RESOURCE_EXHAUSTED ("Stream removed") instead."""
    err = fails(HUGE_CASES[case], _huge_request(case, sc, shared))
    assert len(err.details()) < 4096, f"a {len(err.details())}-byte message"


def test_concurrent_incompatible_creates_of_one_name_make_one_volume(sc: Client) -> None:
    """CreateVolume idempotency under concurrency (a CO that lost state MAY send several calls at
    once): one name never yields two volumes; the losers are ALREADY_EXISTS (or ABORTED)."""
    name = uniq("race")
    before = len(list_all_volumes(sc))
    ids: list[str] = []
    codes: list[Any] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        size = SIZE if i % 2 else 2 * SIZE
        barrier.wait()
        try:
            vid = create(sc, name, size=size, limit=size).volume_id
            with lock:
                ids.append(vid)
        except grpc.RpcError as e:
            with lock:
                codes.append(e.code())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and len(ids) >= 1, ids
    assert set(codes) <= {ALREADY_EXISTS, ABORTED}, codes
    assert len(list_all_volumes(sc)) == before + 1


def test_concurrent_creates_do_not_overcommit_capacity(csi_root: Path) -> None:
    """CreateVolume: a volume the pool cannot hold is RESOURCE_EXHAUSTED (docs: --capacity); creates
    of different names running at once must not together exceed the capacity offered."""
    with own_driver(csi_root, "--capacity", "100Mi", "--max-volume-size", "100Mi") as (_, client):
        made: list[int] = []
        codes: list[Any] = []
        lock = threading.Lock()
        barrier = threading.Barrier(10)

        def worker() -> None:
            barrier.wait()
            try:
                vol = create(client, uniq("overcommit"), size=30 * MiB, limit=30 * MiB)
                with lock:
                    made.append(vol.capacity_bytes)
            except grpc.RpcError as e:
                with lock:
                    codes.append(e.code())

        threads = [threading.Thread(target=worker) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(codes) <= {EXHAUSTED}, codes
        assert sum(made) <= 100 * MiB, f"{len(made)} volumes of 30Mi created against --capacity 100Mi"
        listed = sum(e.volume.capacity_bytes for e in list_all_volumes(client))
        assert listed <= 100 * MiB


def test_capacity_exhaustion(csi_root: Path) -> None:
    """CreateVolume/CreateSnapshot: not enough space is RESOURCE_EXHAUSTED; a size above the
    driver's maximum is OUT_OF_RANGE; GetCapacity reports what is left, never negative."""
    with own_driver(csi_root, "--capacity", "100Mi", "--max-volume-size", "60Mi") as (_, client):
        vol = create(client, size=60 * MiB)
        fails(EXHAUSTED, lambda: create(client, size=60 * MiB))
        fails(OUT_OF_RANGE, lambda: create(client, size=70 * MiB))
        fails(EXHAUSTED, lambda: snapshot(client, vol.volume_id))
        cap = client.controller.GetCapacity(csi_pb2.GetCapacityRequest())
        assert cap.available_capacity == 40 * MiB
        create(client, size=40 * MiB)
        cap = client.controller.GetCapacity(csi_pb2.GetCapacityRequest())
        assert cap.available_capacity == 0 and cap.maximum_volume_size.value >= 0
        fails(EXHAUSTED, lambda: create(client, size=MiB))


def test_get_capacity_bounds_are_usable_in_create_volume(csi_root: Path) -> None:
    """GetCapacity: maximum_volume_size is the largest required_bytes and minimum_volume_size the
    smallest limit_bytes that may be used to create a volume; neither may be negative."""
    with own_driver(csi_root, "--capacity", "100Mi", "--max-volume-size", "60Mi") as (_, client):
        cap = client.controller.GetCapacity(csi_pb2.GetCapacityRequest())
        assert cap.available_capacity == 100 * MiB and cap.maximum_volume_size.value == 60 * MiB
        smallest = cap.minimum_volume_size.value
        assert 0 <= smallest <= cap.maximum_volume_size.value
        tiny = create(client, size=0, limit=smallest)
        assert 0 < tiny.capacity_bytes <= smallest
        for _ in range(2):
            cap = client.controller.GetCapacity(csi_pb2.GetCapacityRequest())
            largest = cap.maximum_volume_size.value
            assert 0 <= largest <= cap.available_capacity
            try:
                vol = create(client, size=largest)
            except grpc.RpcError as e:
                pytest.fail(
                    f"GetCapacity: maximum_volume_size {largest} (available {cap.available_capacity}), "
                    f"but CreateVolume(required_bytes={largest}) -> {e.code().name}: {e.details()}"
                )
            assert vol.capacity_bytes >= largest


# ==================================================================================================
# DeleteVolume
# ==================================================================================================
def test_delete_volume_requires_volume_id(sc: Client) -> None:
    """DeleteVolume: volume_id is REQUIRED (INVALID_ARGUMENT)."""
    fails(INVALID, lambda: sc.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest()))


def test_delete_volume_is_idempotent(sc: Client, shared: Driver) -> None:
    """DeleteVolume MUST be idempotent: a volume that does not exist, or whose artifacts are gone,
    answers OK."""
    sc.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id="vol-never-existed"))
    vol = create(sc)
    for _ in range(2):
        sc.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
    fails(
        NOT_FOUND,
        lambda: sc.controller.ControllerGetVolume(
            csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id)
        ),
    )
    assert vol.volume_id not in {e.volume.volume_id for e in list_all_volumes(sc)}
    gone = create(sc)
    backing_file(shared, gone.volume_id).unlink()
    sc.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=gone.volume_id))
    assert gone.volume_id not in {e.volume.volume_id for e in list_all_volumes(sc)}


def test_delete_published_volume_is_failed_precondition(sc: Client, shared: Driver) -> None:
    """DeleteVolume errors: a volume in use (here: still published to a node) is
    FAILED_PRECONDITION, and the volume is not altered."""
    vol = create(sc)
    controller_publish(sc, vol.volume_id, "node-a", mount_cap())
    try:
        fails(
            PRECONDITION,
            lambda: sc.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id)),
        )
        assert backing_file(shared, vol.volume_id).exists()
    finally:
        controller_unpublish(sc, vol.volume_id, "node-a")
    sc.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))


def test_snapshots_stay_usable_after_their_volume_is_deleted(sc: Client) -> None:
    """DeleteVolume: a plugin that deletes a volume without affecting its snapshots MUST keep them
    fully operational: listed, and usable as a source for new volumes."""
    vol = create(sc)
    snap = snapshot(sc, vol.volume_id)
    sc.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
    listed = sc.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(snapshot_id=snap.snapshot_id))
    assert [e.snapshot.snapshot_id for e in listed.entries] == [snap.snapshot_id]
    assert sc.controller.GetSnapshot(
        csi_pb2.GetSnapshotRequest(snapshot_id=snap.snapshot_id)
    ).snapshot.ready_to_use
    restored = create(sc, volume_content_source=from_snapshot(snap.snapshot_id))
    assert restored.capacity_bytes >= snap.size_bytes


# ==================================================================================================
# ControllerPublishVolume / ControllerUnpublishVolume
# ==================================================================================================
@pytest.mark.parametrize("missing", ["volume_id", "node_id", "volume_capability", "access_mode"])
def test_controller_publish_missing_required_fields(sc: Client, missing: str) -> None:
    """ControllerPublishVolume: volume_id, node_id and volume_capability (with its access mode) are
    REQUIRED: INVALID_ARGUMENT."""
    vol = create(sc)
    kwargs: dict[str, Any] = {
        "volume_id": vol.volume_id,
        "node_id": "node-a",
        "volume_capability": mount_cap(),
    }
    _leave_out(kwargs, missing)
    fails(
        INVALID,
        lambda: sc.controller.ControllerPublishVolume(csi_pb2.ControllerPublishVolumeRequest(**kwargs)),
    )


def test_controller_publish_volume_or_node_not_found(sc: Client, shared: Driver) -> None:
    """ControllerPublishVolume errors: a volume that does not exist is NOT_FOUND; so is a node that
    does not exist (hostile node ids included: never a path, never created)."""
    vol = create(sc)
    nodes_before = sorted(p.name for p in (shared.pool / "nodes").iterdir())
    fails(NOT_FOUND, lambda: controller_publish(sc, "vol-does-not-exist", "node-a", mount_cap()))
    fails(NOT_FOUND, lambda: controller_publish(sc, vol.volume_id, "node-nowhere", mount_cap()))
    for node in ("../../../etc/passwd", "node-a\x00", "n" * 300, ".", "node-a/../node-b"):
        fails((NOT_FOUND, INVALID), partial(controller_publish, sc, vol.volume_id, node, mount_cap()))
    assert sorted(p.name for p in (shared.pool / "nodes").iterdir()) == nodes_before


def test_controller_publish_is_idempotent_and_readonly_mismatch_already_exists(sc: Client) -> None:
    """ControllerPublishVolume MUST be idempotent: a repeat compatible with the publication answers
    OK (with the same publish_context); one with another readonly flag is ALREADY_EXISTS."""
    vol = create(sc)
    try:
        first = controller_publish(sc, vol.volume_id, "node-a", mount_cap())
        assert controller_publish(sc, vol.volume_id, "node-a", mount_cap()) == first
        fails(
            ALREADY_EXISTS,
            lambda: controller_publish(sc, vol.volume_id, "node-a", mount_cap(), readonly=True),
        )
    finally:
        controller_unpublish(sc, vol.volume_id, "node-a")


def test_controller_publish_with_an_incompatible_capability_already_exists(sc: Client) -> None:
    """ControllerPublishVolume errors: a volume already published at the node but incompatible with
    the requested volume_capability (here a block capability for the mount publication) is
    ALREADY_EXISTS."""
    vol = create(sc)
    try:
        controller_publish(sc, vol.volume_id, "node-a", mount_cap())
        fails(ALREADY_EXISTS, lambda: controller_publish(sc, vol.volume_id, "node-a", block_cap()))
    finally:
        controller_unpublish(sc, vol.volume_id, "node-a")


SINGLE_NODE = [
    Mode.SINGLE_NODE_WRITER,
    Mode.SINGLE_NODE_READER_ONLY,
    Mode.SINGLE_NODE_SINGLE_WRITER,
    Mode.SINGLE_NODE_MULTI_WRITER,
]


@pytest.mark.parametrize("mode", SINGLE_NODE, ids=[Mode.Name(m) for m in SINGLE_NODE])
def test_controller_publish_single_node_volume_to_second_node_fails_precondition(
    sc: Client, mode: int
) -> None:
    """ControllerPublishVolume errors: a volume published at another node without a MULTI_NODE
    capability is FAILED_PRECONDITION, and the message SHOULD name the node it is published at."""
    cap = mount_cap(mode=mode)
    vol = create(sc, cap=cap)
    readonly = mode == Mode.SINGLE_NODE_READER_ONLY
    try:
        controller_publish(sc, vol.volume_id, "node-a", cap, readonly)
        err = fails(PRECONDITION, lambda: controller_publish(sc, vol.volume_id, "node-b", cap, readonly))
        assert "node-a" in err.details()
    finally:
        controller_unpublish(sc, vol.volume_id)


def test_multi_node_publication_and_unpublish_from_every_node(sc: Client) -> None:
    """ControllerPublishVolume MAY publish a MULTI_NODE volume at several nodes; ControllerUnpublish
    with node_id unset MUST unpublish it from every node."""
    cap = mount_cap(mode=Mode.MULTI_NODE_READER_ONLY)
    vol = create(sc, cap=cap)
    for node in ("node-a", "node-b"):
        controller_publish(sc, vol.volume_id, node, cap, readonly=True)
    got = sc.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id))
    assert sorted(got.status.published_node_ids) == ["node-a", "node-b"]
    controller_unpublish(sc, vol.volume_id)
    got = sc.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id))
    assert list(got.status.published_node_ids) == []


def test_controller_publish_above_max_volumes_is_resource_exhausted(sc: Client, shared: Driver) -> None:
    """ControllerPublishVolume errors: a node that already has its maximum of volumes attached is
    RESOURCE_EXHAUSTED until one is detached; a repeat of an existing publication stays OK."""
    announce(shared, "node-m", max_volumes=1)
    first, second = create(sc).volume_id, create(sc).volume_id
    try:
        controller_publish(sc, first, "node-m", mount_cap())
        fails(EXHAUSTED, lambda: controller_publish(sc, second, "node-m", mount_cap()))
        controller_publish(sc, first, "node-m", mount_cap())
        controller_unpublish(sc, first, "node-m")
        controller_publish(sc, second, "node-m", mount_cap())
    finally:
        controller_unpublish(sc, first)
        controller_unpublish(sc, second)


def test_controller_unpublish_is_idempotent(sc: Client) -> None:
    """ControllerUnpublishVolume: volume_id is REQUIRED (INVALID_ARGUMENT); MUST be idempotent: a
    volume not attached to the node answers OK, and an unknown volume or node SHOULD answer OK."""
    fails(
        INVALID,
        lambda: sc.controller.ControllerUnpublishVolume(
            csi_pb2.ControllerUnpublishVolumeRequest(node_id="node-a")
        ),
    )
    vol = create(sc)
    controller_unpublish(sc, vol.volume_id, "node-a")
    controller_unpublish(sc, "vol-does-not-exist", "node-a")
    controller_unpublish(sc, vol.volume_id, "node-never-seen")
    controller_publish(sc, vol.volume_id, "node-a", mount_cap())
    for _ in range(2):
        controller_unpublish(sc, vol.volume_id, "node-a")


# ==================================================================================================
# ValidateVolumeCapabilities
# ==================================================================================================
def test_validate_volume_capabilities_required_fields_and_not_found(sc: Client) -> None:
    """ValidateVolumeCapabilities: volume_id and volume_capabilities are REQUIRED
    (INVALID_ARGUMENT); a volume that does not exist is NOT_FOUND."""
    vol = create(sc)
    validate = sc.controller.ValidateVolumeCapabilities
    fails(
        INVALID,
        lambda: validate(csi_pb2.ValidateVolumeCapabilitiesRequest(volume_capabilities=[mount_cap()])),
    )
    fails(INVALID, lambda: validate(csi_pb2.ValidateVolumeCapabilitiesRequest(volume_id=vol.volume_id)))
    fails(
        NOT_FOUND,
        lambda: validate(
            csi_pb2.ValidateVolumeCapabilitiesRequest(
                volume_id="vol-does-not-exist", volume_capabilities=[mount_cap()]
            )
        ),
    )


@pytest.mark.parametrize("broken", [_no_mode_cap(), _no_type_cap()], ids=["no-access-mode", "no-access-type"])
def test_validate_volume_capabilities_missing_capability_fields_are_invalid(sc: Client, broken: Any) -> None:
    """VolumeCapability: access_type and access_mode are REQUIRED; a capability lacking one is a
    missing required field, INVALID_ARGUMENT (not an answer of "unsupported")."""
    vol = create(sc)
    fails(
        INVALID,
        lambda: sc.controller.ValidateVolumeCapabilities(
            csi_pb2.ValidateVolumeCapabilitiesRequest(volume_id=vol.volume_id, volume_capabilities=[broken])
        ),
    )


def test_validate_volume_capabilities_confirms_only_what_is_supported(sc: Client) -> None:
    """ValidateVolumeCapabilities SHALL return `confirmed` only if ALL capabilities are supported,
    and then lists them; otherwise `confirmed` is empty (a message MAY say why)."""
    vol = create(sc, cap=mount_cap("ext4"))
    good = [mount_cap(), mount_cap("ext4", Mode.MULTI_NODE_READER_ONLY)]
    rsp = sc.controller.ValidateVolumeCapabilities(
        csi_pb2.ValidateVolumeCapabilitiesRequest(volume_id=vol.volume_id, volume_capabilities=good)
    )
    assert rsp.HasField("confirmed") and list(rsp.confirmed.volume_capabilities) == good
    for bad in (
        [mount_cap(mode=Mode.MULTI_NODE_MULTI_WRITER)],
        [mount_cap("ntfs")],
        [mount_cap("xfs")],  # the volume is ext4
        [mount_cap(), mount_cap("ntfs")],
    ):
        rsp = sc.controller.ValidateVolumeCapabilities(
            csi_pb2.ValidateVolumeCapabilitiesRequest(volume_id=vol.volume_id, volume_capabilities=bad)
        )
        assert not rsp.HasField("confirmed") and rsp.message, bad


def test_validate_volume_capabilities_of_a_block_volume_with_a_filesystem_capability(sc: Client) -> None:
    """ValidateVolumeCapabilities SHALL confirm only capabilities the volume supports: a raw block
    volume cannot be used through a filesystem capability (staging it so would format the data)."""
    vol = create(sc, cap=block_cap())
    rsp = sc.controller.ValidateVolumeCapabilities(
        csi_pb2.ValidateVolumeCapabilitiesRequest(volume_id=vol.volume_id, volume_capabilities=[mount_cap()])
    )
    assert not rsp.HasField("confirmed"), "a block volume was confirmed for a mount capability"


# ==================================================================================================
# ListVolumes / ControllerGetVolume
# ==================================================================================================
BAD_TOKENS = ["garbage", "s", "s-1", "S1", " s1", "s1\n", "s" + "9" * 20, "\x00", "é", "t" * 100_000]


@pytest.mark.parametrize("token", BAD_TOKENS, ids=range(len(BAD_TOKENS)))
def test_list_volumes_invalid_starting_token_is_aborted(sc: Client, token: str) -> None:
    """ListVolumes errors: a starting_token that is not valid is ABORTED."""
    fails(ABORTED, lambda: sc.controller.ListVolumes(csi_pb2.ListVolumesRequest(starting_token=token)))


def test_list_volumes_negative_max_entries_is_invalid(sc: Client) -> None:
    """ListVolumes: max_entries MUST NOT be negative (an invalid field, INVALID_ARGUMENT)."""
    fails(INVALID, lambda: sc.controller.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=-1)))


def test_list_volumes_pages_and_statuses(sc: Client) -> None:
    """ListVolumes: no more entries than max_entries, next_token set while more remain; every volume
    the plugin knows is listed; with LIST_VOLUMES_PUBLISHED_NODES and VOLUME_CONDITION each entry
    MUST carry a status with the published nodes and a volume condition."""
    mine = {create(sc).volume_id for _ in range(3)}
    published = sorted(mine)[0]
    controller_publish(sc, published, "node-a", mount_cap())
    try:
        entries = list_all_volumes(sc, page=2)
        ids = [e.volume.volume_id for e in entries]
        assert len(ids) == len(set(ids)) and mine <= set(ids)
        for e in entries:
            assert e.HasField("status") and e.status.HasField("volume_condition")
            assert e.status.volume_condition.message and e.volume.capacity_bytes >= 0
        by_id = {e.volume.volume_id: e for e in entries}
        assert list(by_id[published].status.published_node_ids) == ["node-a"]
        whole = sc.controller.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=len(ids) + 10))
        assert whole.next_token == "" and len(whole.entries) == len(ids)
    finally:
        controller_unpublish(sc, published)


def test_volume_context_is_the_same_everywhere(sc: Client) -> None:
    """Volume.volume_context: a volume SHALL always report the same volume_context (CreateVolume,
    its idempotent repeat, ListVolumes, ControllerGetVolume)."""
    name = uniq("ctx")
    vol = create(sc, name)
    contexts = [dict(vol.volume_context), dict(create(sc, name).volume_context)]
    contexts += [
        dict(e.volume.volume_context) for e in list_all_volumes(sc) if e.volume.volume_id == vol.volume_id
    ]
    got = sc.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id))
    contexts.append(dict(got.volume.volume_context))
    assert len(contexts) == 4 and all(c == contexts[0] for c in contexts), contexts


def test_list_volumes_shows_what_a_killed_create_volume_left(csi_root: Path) -> None:
    """ListVolumes SHALL return every volume the plugin knows about (a CO whose CreateVolume timed
    out uses it to find and delete the volume): what a CreateVolume killed between its record and
    its backing file left is listed, or rolled back at start - never hidden while it holds capacity."""
    with own_driver(csi_root, "--capacity", "100Mi") as (d, client):
        vol = create(client, uniq("killed"), size=40 * MiB)
        d.stop()
        # The state a kill -9 leaves between "record written (not ready)" and "file renamed into
        # place" (docs: CreateVolume writes the record before the file).
        record = d.state / "volumes" / f"{vol.volume_id}.json"
        doc = json.loads(record.read_text())
        doc["ready"] = False
        record.write_text(json.dumps(doc))
        backing_file(d, vol.volume_id).unlink()
        d.start()
        fresh = Client(d.endpoint)
        try:
            listed = {e.volume.volume_id for e in list_all_volumes(fresh)}
            available = fresh.controller.GetCapacity(csi_pb2.GetCapacityRequest()).available_capacity
            assert vol.volume_id in listed or available == 100 * MiB, (
                f"the volume of a killed CreateVolume is not listed, yet holds {100 * MiB - available} bytes"
            )
            fresh.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
            assert fresh.controller.GetCapacity(csi_pb2.GetCapacityRequest()).available_capacity == 100 * MiB
        finally:
            fresh.close()


def test_list_snapshots_never_shows_what_a_killed_create_snapshot_left(csi_root: Path) -> None:
    """ListSnapshots SHALL NOT list a snapshot that is being created but has not been cut: what a
    CreateSnapshot killed before its copy was complete left is rolled back (its room given back)
    or finished, never listed half-made."""
    with own_driver(csi_root, "--capacity", "100Mi") as (d, client):
        vol = create(client, size=20 * MiB)
        snap = snapshot(client, vol.volume_id)
        d.stop()
        record = d.state / "snapshots" / f"{snap.snapshot_id}.json"
        doc = json.loads(record.read_text())
        doc["ready"] = False
        record.write_text(json.dumps(doc))
        (d.pool / "snapshots" / f"{snap.snapshot_id}.img").unlink()
        d.start()
        fresh = Client(d.endpoint)
        try:
            listed = fresh.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest()).entries
            available = fresh.controller.GetCapacity(csi_pb2.GetCapacityRequest()).available_capacity
            if any(e.snapshot.snapshot_id == snap.snapshot_id for e in listed):
                assert all(e.snapshot.ready_to_use for e in listed)
                assert (d.pool / "snapshots" / f"{snap.snapshot_id}.img").exists()
            else:
                assert available == 80 * MiB, f"a half-made snapshot holds {80 * MiB - available} bytes"
        finally:
            fresh.close()


def test_controller_get_volume(sc: Client) -> None:
    """ControllerGetVolume: volume_id is REQUIRED (INVALID_ARGUMENT); a volume that does not exist
    is NOT_FOUND; with VOLUME_CONDITION the status MUST carry a non-empty volume_condition."""
    fails(INVALID, lambda: sc.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest()))
    fails(
        NOT_FOUND,
        lambda: sc.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id="vol-nope")),
    )
    vol = create(sc)
    got = sc.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id))
    assert got.volume.volume_id == vol.volume_id and got.HasField("status")
    assert got.status.HasField("volume_condition") and got.status.volume_condition.message
    assert not got.status.volume_condition.abnormal


# ==================================================================================================
# GetCapacity
# ==================================================================================================
def test_get_capacity_values(sc: Client) -> None:
    """GetCapacity: available_capacity is REQUIRED and not negative, nor are the optional bounds;
    capacity for capabilities the plugin cannot provision is 0."""
    cap = sc.controller.GetCapacity(
        csi_pb2.GetCapacityRequest(volume_capabilities=[mount_cap(), block_cap()])
    )
    assert cap.available_capacity >= 0 and cap.maximum_volume_size.value >= 0
    assert 0 <= cap.minimum_volume_size.value <= cap.maximum_volume_size.value
    none = sc.controller.GetCapacity(
        csi_pb2.GetCapacityRequest(volume_capabilities=[mount_cap(mode=Mode.MULTI_NODE_MULTI_WRITER)])
    )
    assert none.available_capacity == 0


def test_get_capacity_takes_parameters_into_account(sc: Client) -> None:
    """GetCapacity: with `parameters` the plugin SHALL report the capacity usable for volumes with
    those parameters; parameters CreateVolume refuses leave none (0, or INVALID_ARGUMENT)."""
    for params in ({"csi.storage.k8s.io/fstype": "ntfs"}, {"no-such-parameter": "1"}):
        try:
            rsp = sc.controller.GetCapacity(csi_pb2.GetCapacityRequest(parameters=params))
        except grpc.RpcError as e:
            assert e.code() == INVALID, e
        else:
            assert rsp.available_capacity == 0, f"{rsp.available_capacity} bytes for {params}"


def test_get_capacity_capability_missing_required_fields_is_invalid(sc: Client) -> None:
    """VolumeCapability: access_mode is REQUIRED; GetCapacity given a capability without one has a
    missing required field: INVALID_ARGUMENT."""
    fails(
        INVALID,
        lambda: sc.controller.GetCapacity(csi_pb2.GetCapacityRequest(volume_capabilities=[_no_mode_cap()])),
    )


# ==================================================================================================
# ControllerExpandVolume
# ==================================================================================================
def expand(client: Client, volume_id: str, required: int = 0, limit: int = 0, **kw: object) -> Any:
    return client.controller.ControllerExpandVolume(
        csi_pb2.ControllerExpandVolumeRequest(
            volume_id=volume_id,
            capacity_range=csi_pb2.CapacityRange(required_bytes=required, limit_bytes=limit),
            **kw,
        )
    )


def test_controller_expand_required_fields_and_not_found(sc: Client) -> None:
    """ControllerExpandVolume: volume_id and capacity_range are REQUIRED (INVALID_ARGUMENT);
    negative bounds are invalid; a volume that does not exist is NOT_FOUND."""
    vol = create(sc)
    expand_rpc = sc.controller.ControllerExpandVolume
    fails(
        INVALID,
        lambda: expand_rpc(
            csi_pb2.ControllerExpandVolumeRequest(capacity_range=csi_pb2.CapacityRange(required_bytes=SIZE))
        ),
    )
    fails(INVALID, lambda: expand_rpc(csi_pb2.ControllerExpandVolumeRequest(volume_id=vol.volume_id)))
    fails(INVALID, lambda: expand(sc, vol.volume_id, required=-1))
    fails(INVALID, lambda: expand(sc, vol.volume_id, required=2 * SIZE, limit=-1))
    fails(NOT_FOUND, lambda: expand(sc, "vol-does-not-exist", required=2 * SIZE))


def test_controller_expand_capacity_range_with_neither_bound_is_invalid(sc: Client) -> None:
    """ControllerExpandVolume: capacity_range is REQUIRED and at least one of its bounds MUST be
    set; a capacity_range with neither is INVALID_ARGUMENT."""
    vol = create(sc)
    fails(INVALID, lambda: expand(sc, vol.volume_id))


def test_controller_expand_unsupported_capacity_or_capability(sc: Client) -> None:
    """ControllerExpandVolume errors: an unsupported capacity_range is OUT_OF_RANGE; a
    volume_capability the volume does not support is INVALID_ARGUMENT (exceeds capabilities)."""
    vol = create(sc)
    fails(OUT_OF_RANGE, lambda: expand(sc, vol.volume_id, required=4 << 40))
    fails(OUT_OF_RANGE, lambda: expand(sc, vol.volume_id, required=4 * SIZE, limit=2 * SIZE))
    fails(
        INVALID,
        lambda: expand(
            sc,
            vol.volume_id,
            required=2 * SIZE,
            volume_capability=mount_cap(mode=Mode.MULTI_NODE_MULTI_WRITER),
        ),
    )
    fails(INVALID, lambda: expand(sc, vol.volume_id, required=2 * SIZE, volume_capability=mount_cap("ntfs")))


def test_controller_expand_is_idempotent_and_honours_the_range(sc: Client) -> None:
    """ControllerExpandVolume MUST be idempotent: a volume already at least the requested size
    answers OK; the reported capacity lies within the capacity_range."""
    vol = create(sc, size=SIZE)
    rsp = expand(sc, vol.volume_id, required=SIZE + MiB + 1, limit=SIZE + 2 * MiB)
    assert SIZE + MiB + 1 <= rsp.capacity_bytes <= SIZE + 2 * MiB
    again = expand(sc, vol.volume_id, required=SIZE + MiB + 1, limit=SIZE + 2 * MiB)
    assert again.capacity_bytes == rsp.capacity_bytes
    assert expand(sc, vol.volume_id, required=SIZE // 2).capacity_bytes >= SIZE // 2


def test_controller_expand_of_a_published_volume(sc: Client) -> None:
    """VolumeExpansion ONLINE with the EXPAND_VOLUME controller capability: the plugin MUST support
    expanding volumes currently published; a filesystem volume needs NodeExpandVolume after."""
    vol = create(sc)
    controller_publish(sc, vol.volume_id, "node-a", mount_cap())
    try:
        rsp = expand(sc, vol.volume_id, required=2 * SIZE)
        assert rsp.capacity_bytes >= 2 * SIZE and rsp.node_expansion_required
    finally:
        controller_unpublish(sc, vol.volume_id)


# ==================================================================================================
# Snapshots
# ==================================================================================================
def test_create_snapshot_required_fields_and_not_found(sc: Client) -> None:
    """CreateSnapshot: name and source_volume_id are REQUIRED (INVALID_ARGUMENT); a source volume
    that does not exist (or is a snapshot: snapshots of snapshots are not a thing) is NOT_FOUND."""
    vol = create(sc)
    snap = snapshot(sc, vol.volume_id)
    fails(
        INVALID,
        lambda: sc.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(source_volume_id=vol.volume_id)),
    )
    fails(INVALID, lambda: sc.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(name=uniq("s"))))
    fails(NOT_FOUND, lambda: snapshot(sc, "vol-does-not-exist"))
    fails(NOT_FOUND, lambda: snapshot(sc, snap.snapshot_id))


def test_create_snapshot_idempotent_and_incompatible_already_exists(sc: Client) -> None:
    """CreateSnapshot MUST be idempotent: a repeat answers OK with the same snapshot; a snapshot of
    that name from another volume is ALREADY_EXISTS. A snapshot carries its id, source volume,
    creation time and ready_to_use; its size is not negative."""
    vol, other = create(sc), create(sc)
    name = uniq("snap")
    snap = snapshot(sc, vol.volume_id, name)
    assert snap.snapshot_id and snap.source_volume_id == vol.volume_id and snap.ready_to_use
    assert snap.HasField("creation_time") and snap.creation_time.seconds > 0 and snap.size_bytes >= 0
    assert snapshot(sc, vol.volume_id, name).snapshot_id == snap.snapshot_id
    fails(ALREADY_EXISTS, lambda: snapshot(sc, other.volume_id, name))


def test_concurrent_snapshots_of_one_name_make_one_snapshot(sc: Client) -> None:
    """CreateSnapshot idempotency under concurrency: one name yields one snapshot (losers MAY be
    ABORTED)."""
    vol = create(sc)
    name = uniq("snap-race")
    ids: list[str] = []
    codes: list[Any] = []
    lock = threading.Lock()
    barrier = threading.Barrier(6)

    def worker() -> None:
        barrier.wait()
        try:
            sid = snapshot(sc, vol.volume_id, name).snapshot_id
            with lock:
                ids.append(sid)
        except grpc.RpcError as e:
            with lock:
                codes.append(e.code())

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and set(codes) <= {ABORTED}, (ids, codes)
    listed = sc.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(source_volume_id=vol.volume_id))
    assert [e.snapshot.snapshot_id for e in listed.entries] == ids[:1]


def test_delete_snapshot_is_idempotent(sc: Client) -> None:
    """DeleteSnapshot: snapshot_id is REQUIRED (INVALID_ARGUMENT); MUST be idempotent: a snapshot
    that does not exist answers OK. A deleted snapshot is NOT_FOUND for GetSnapshot and as a
    CreateVolume source."""
    fails(INVALID, lambda: sc.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest()))
    sc.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id="snap-never-existed"))
    snap = snapshot(sc, create(sc).volume_id)
    for _ in range(2):
        sc.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))
    fails(
        NOT_FOUND, lambda: sc.controller.GetSnapshot(csi_pb2.GetSnapshotRequest(snapshot_id=snap.snapshot_id))
    )
    fails(NOT_FOUND, lambda: create(sc, volume_content_source=from_snapshot(snap.snapshot_id)))


@pytest.mark.parametrize("token", BAD_TOKENS[:6], ids=range(6))
def test_list_snapshots_invalid_starting_token_is_aborted(sc: Client, token: str) -> None:
    """ListSnapshots errors: a starting_token that is not valid is ABORTED."""
    fails(ABORTED, lambda: sc.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(starting_token=token)))


def test_list_snapshots_filters_and_pages(sc: Client) -> None:
    """ListSnapshots: max_entries MUST NOT be negative (INVALID_ARGUMENT) and bounds each page, with
    next_token while more remain; snapshot_id and source_volume_id filter; an unknown id lists
    nothing (not an error)."""
    fails(INVALID, lambda: sc.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(max_entries=-1)))
    vol = create(sc)
    mine = [snapshot(sc, vol.volume_id).snapshot_id for _ in range(3)]
    for unknown in ("snap-unknown", "../../etc/passwd", "x" * 1000):
        assert not sc.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(snapshot_id=unknown)).entries
        assert not sc.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(source_volume_id=unknown)).entries
    by_source = sc.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(source_volume_id=vol.volume_id))
    assert sorted(e.snapshot.snapshot_id for e in by_source.entries) == sorted(mine)
    one = sc.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(snapshot_id=mine[1]))
    assert [e.snapshot.snapshot_id for e in one.entries] == [mine[1]]
    seen: list[str] = []
    token = ""
    while True:
        page = sc.controller.ListSnapshots(
            csi_pb2.ListSnapshotsRequest(source_volume_id=vol.volume_id, max_entries=2, starting_token=token)
        )
        assert len(page.entries) <= 2
        seen += [e.snapshot.snapshot_id for e in page.entries]
        token = page.next_token
        if not token:
            break
    assert sorted(seen) == sorted(mine)


def test_get_snapshot(sc: Client) -> None:
    """GetSnapshot: snapshot_id is REQUIRED (INVALID_ARGUMENT); a snapshot that does not exist is
    NOT_FOUND."""
    fails(INVALID, lambda: sc.controller.GetSnapshot(csi_pb2.GetSnapshotRequest()))
    fails(NOT_FOUND, lambda: sc.controller.GetSnapshot(csi_pb2.GetSnapshotRequest(snapshot_id="snap-nope")))
    snap = snapshot(sc, create(sc).volume_id)
    got = sc.controller.GetSnapshot(csi_pb2.GetSnapshotRequest(snapshot_id=snap.snapshot_id)).snapshot
    assert got.snapshot_id == snap.snapshot_id and got.source_volume_id == snap.source_volume_id


# ==================================================================================================
# Node: info and capabilities
# ==================================================================================================
_PREFIX = r"[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?"
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"


def test_node_get_info(sc: Client) -> None:
    """NodeGetInfo: node_id is REQUIRED and at most 256 bytes; max_volumes_per_node MUST NOT be
    negative; returning accessible_topology requires VOLUME_ACCESSIBILITY_CONSTRAINTS, and topology
    keys (DNS prefix / name) and values follow the spec's format."""
    info = sc.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest())
    assert info.node_id == "node-a" and len(info.node_id.encode()) <= 256
    assert info.max_volumes_per_node >= 0
    plugin = sc.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest())
    assert PluginService.VOLUME_ACCESSIBILITY_CONSTRAINTS in {c.service.type for c in plugin.capabilities}
    for key, value in info.accessible_topology.segments.items():
        prefix, _, name = key.rpartition("/")
        assert not prefix or re.fullmatch(_PREFIX, prefix), key
        assert re.fullmatch(_NAME, name) and re.fullmatch(_NAME, value), (key, value)
    # A key prefix MUST be identical across all topology keys the SP returns, in every RPC.
    vol = create(sc, accessibility_requirements=csi_pb2.TopologyRequirement(requisite=topology("node-a")))
    prefixes = {k.rpartition("/")[0] for t in vol.accessible_topology for k in t.segments}
    prefixes |= {k.rpartition("/")[0] for k in info.accessible_topology.segments}
    assert len(prefixes) == 1, prefixes


def test_node_capabilities_are_served(sc: Client) -> None:
    """NodeGetCapabilities: the driver stages (STAGE_UNSTAGE_VOLUME) and, with GET_VOLUME_STATS,
    MUST implement NodeGetVolumeStats; a node plugin MUST implement NodeUnpublishVolume."""
    caps = {
        c.rpc.type for c in sc.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest()).capabilities
    }
    assert {NodeRPC.STAGE_UNSTAGE_VOLUME, NodeRPC.GET_VOLUME_STATS} <= caps
    # Implemented: argument errors, not UNIMPLEMENTED.
    fails(INVALID, lambda: sc.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest()))
    fails(INVALID, lambda: sc.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest()))


# ==================================================================================================
# NodeStageVolume / NodeUnstageVolume
# ==================================================================================================
@pytest.mark.parametrize("missing", ["volume_id", "staging_target_path", "volume_capability", "access_mode"])
def test_node_stage_missing_required_fields(sc: Client, shared: Driver, missing: str) -> None:
    """NodeStageVolume: volume_id, staging_target_path and volume_capability (with its access mode)
    are REQUIRED: INVALID_ARGUMENT."""
    vol = create(sc)
    kwargs: dict[str, Any] = {
        "volume_id": vol.volume_id,
        "staging_target_path": str(shared.kubelet / uniq("staging")),
        "volume_capability": mount_cap(),
    }
    _leave_out(kwargs, missing)
    fails(INVALID, lambda: sc.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(**kwargs)))


def test_node_stage_unknown_volume_is_not_found(sc: Client, shared: Driver) -> None:
    """NodeStageVolume errors: a volume that does not exist is NOT_FOUND."""
    staging = str(shared.kubelet / uniq("staging"))
    fails(NOT_FOUND, lambda: stage(sc, "vol-does-not-exist", staging, mount_cap()))


def test_node_stage_hostile_paths_are_invalid(sc: Client, shared: Driver) -> None:
    """NodeStageVolume: staging_target_path MUST be an absolute path; the driver confines it
    strictly under its kubelet directory (docs: security): relative, escaping, NUL-bearing or
    longer-than-PATH_MAX paths are INVALID_ARGUMENT, and nothing is mounted."""
    vol = create(sc)
    kubelet = str(shared.kubelet)
    for path in (
        "relative/staging",
        f"{kubelet}/../outside",
        f"{kubelet}/a/./b",
        kubelet,
        "/",
        "/tmp/outside-the-kubelet-dir",
        f"{kubelet}/nul\x00byte",
        f"{kubelet}/" + "p" * 5000,
        f"{kubelet}/" + "/".join(["d" * 200] * 30),
    ):
        fails(
            INVALID,
            partial(
                sc.node.NodeStageVolume,
                csi_pb2.NodeStageVolumeRequest(
                    volume_id=vol.volume_id, staging_target_path=path, volume_capability=mount_cap()
                ),
            ),
        )
    assert not (shared.kubelet.parent / "outside").exists()
    assert not loop_devices_under(backing_file(shared, vol.volume_id))


def test_node_stage_accepts_a_128_byte_path_and_is_idempotent(sc: Client, shared: Driver) -> None:
    """NodeStageVolume: the SP MUST accept staging paths of at least 128 bytes; the call MUST be
    idempotent: staged again at the same path with the same capability answers OK."""
    vol = create(sc)
    base = f"{shared.kubelet}/{uniq('s')}-"
    staging = base + "x" * (128 - len(base))
    assert len(staging.encode()) == 128
    stage(sc, vol.volume_id, staging, mount_cap())
    try:
        stage(sc, vol.volume_id, staging, mount_cap())
        assert os.path.ismount(staging)
        assert len(loop_devices_under(backing_file(shared, vol.volume_id))) == 1
    finally:
        unstage(sc, vol.volume_id, staging)


def test_node_stage_with_another_access_type_already_exists(sc: Client, shared: Driver) -> None:
    """NodeStageVolume errors: a volume already staged at the staging_target_path but incompatible
    with the volume_capability is ALREADY_EXISTS."""
    vol = create(sc)
    with staged(sc, shared, vol.volume_id, mount_cap()) as staging:
        fails(ALREADY_EXISTS, lambda: stage(sc, vol.volume_id, staging, block_cap()))


@pytest.mark.parametrize(
    "other",
    [mount_cap("xfs"), _cap_with_flag("noatime"), mount_cap(mode=Mode.MULTI_NODE_READER_ONLY)],
    ids=["other-fs-type", "other-mount-flags", "other-access-mode"],
)
def test_node_stage_with_a_different_mount_capability_already_exists(
    sc: Client, shared: Driver, other: Any
) -> None:
    """NodeStageVolume: OK for a repeat only when the capability is identical; a volume staged at
    the path with another capability (fs type, mount flags, access mode) is ALREADY_EXISTS."""
    vol = create(sc, cap=mount_cap("ext4"))
    with staged(sc, shared, vol.volume_id, mount_cap("ext4")) as staging:
        fails(ALREADY_EXISTS, lambda: stage(sc, vol.volume_id, staging, other))


def test_node_stage_of_a_block_volume_through_a_filesystem_capability(sc: Client, shared: Driver) -> None:
    """NodeStageVolume errors: capabilities the volume does not support are FAILED_PRECONDITION;
    a raw block volume holding a workload's data is never formatted by a mount capability."""
    vol = create(sc, cap=block_cap())
    data = os.urandom(MiB)
    with staged(sc, shared, vol.volume_id, block_cap()) as staging:
        target = target_path(shared)
        publish(sc, vol.volume_id, staging, target, block_cap())
        fd = os.open(target, os.O_RDWR)
        try:
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        unpublish(sc, vol.volume_id, target)
    with staged_or_error(sc, shared, vol.volume_id, mount_cap()) as error:
        pass
    with open(backing_file(shared, vol.volume_id), "rb") as f:
        intact = f.read(MiB) == data
    outcome = "OK" if error is None else f"{error.code().name}: {error.details()}"
    assert error is not None and error.code() == PRECONDITION and intact, (
        f"NodeStageVolume of a block volume with a mount capability -> {outcome}; data intact: {intact}"
    )


def _tool_runs_since(d: Driver, offset: int) -> list[str]:
    with open(d.log, "rb") as f:
        f.seek(offset)
        tail = f.read().decode(errors="replace")
    return [line for line in tail.splitlines() if 'msg="ran tool"' in line]


@pytest.mark.parametrize("where", ["volume_context", "publish_context"])
@pytest.mark.parametrize("fs_type", ["ntfs", "../../../bin/sh", "ext4\x00", "ext4 -O ^has_journal"])
def test_node_stage_validates_fs_type_from_contexts_before_running_tools(
    sc: Client, shared: Driver, where: str, fs_type: str
) -> None:
    """NodeStageVolume: an fsType the plugin does not support is refused (invalid field,
    INVALID_ARGUMENT, or capability not supported, FAILED_PRECONDITION) wherever it comes from -
    the capability, volume_context or publish_context - before any tool runs on the device."""
    vol = create(sc)
    offset = shared.log.stat().st_size
    with staged_or_error(sc, shared, vol.volume_id, mount_cap(), **{where: {"fsType": fs_type}}) as error:
        assert error is not None, f"staged with fsType {fs_type!r} from {where}"
        assert error.code() in (INVALID, PRECONDITION), f"{error.code().name}: {error.details()}"
        assert not _tool_runs_since(shared, offset), _tool_runs_since(shared, offset)
    assert os.stat(backing_file(shared, vol.volume_id)).st_blocks == 0, "the device was written to"


def test_symlinked_backing_file_is_never_followed(driver: Driver, client: Client) -> None:
    """NodeStageVolume / ControllerExpandVolume / CreateSnapshot: a backing file replaced by a
    symlink (a hostile pool) must not be followed: the file it points to is never attached,
    formatted, grown or copied."""
    vol = create(client, size=SIZE)
    canary = driver.root / "canary.img"
    pattern = b"precious host data " * 55_189  # ~1 MiB, no filesystem signature
    canary.write_bytes(pattern)
    backing = backing_file(driver, vol.volume_id)
    backing.unlink()
    backing.symlink_to(canary)
    problems: list[str] = []

    def check(step: str) -> None:
        if canary.read_bytes() != pattern:
            problems.append(f"{step} changed the file the symlink points to")
        if loop_devices_under(canary):
            problems.append(f"{step} attached the file the symlink points to")

    with contextlib.suppress(grpc.RpcError):
        expand(client, vol.volume_id, required=2 * SIZE)
    check("ControllerExpandVolume")
    try:
        snap = snapshot(client, vol.volume_id)
    except grpc.RpcError:
        pass
    else:
        copy = driver.pool / "snapshots" / f"{snap.snapshot_id}.img"
        if b"precious host data" in copy.read_bytes():
            problems.append("CreateSnapshot copied the file the symlink points to")
    with staged_or_error(client, driver, vol.volume_id, mount_cap()) as error:
        check("NodeStageVolume")
        if error is None:
            problems.append("NodeStageVolume staged a symlinked backing file")
        elif error.code() == Code.UNKNOWN:
            problems.append(f"NodeStageVolume answered UNKNOWN: {error.details()}")
    client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
    check("DeleteVolume")
    assert not problems, problems


@pytest.mark.parametrize("name", ["sp ace", "tab\there", "new\nline", "back\\040slash", "ü-ñ-日本"])
def test_node_paths_with_special_characters_round_trip(sc: Client, shared: Driver, name: str) -> None:
    """NodeStage/Publish/Unpublish/Unstage: a path with whitespace, a newline, mount-table escapes
    or non-ASCII characters is either refused (INVALID_ARGUMENT) or staged, published, reported
    and fully undone: nothing stays mounted or attached."""
    vol = create(sc)
    staging = str(shared.kubelet / f"st-{uniq(name)}")
    target = str(shared.kubelet / f"tg-{uniq(name)}")
    try:
        stage(sc, vol.volume_id, staging, mount_cap())
    except grpc.RpcError as e:
        assert e.code() == INVALID, e
        return
    try:
        publish(sc, vol.volume_id, staging, target, mount_cap())
        assert os.path.ismount(staging) and os.path.ismount(target)
        stats = sc.node.NodeGetVolumeStats(
            csi_pb2.NodeGetVolumeStatsRequest(volume_id=vol.volume_id, volume_path=target)
        )
        assert not stats.volume_condition.abnormal, stats.volume_condition.message
    finally:
        unpublish(sc, vol.volume_id, target)
        unstage(sc, vol.volume_id, staging)
    assert not os.path.ismount(staging) and not os.path.exists(target)
    assert not loop_devices_under(backing_file(shared, vol.volume_id))


def test_concurrent_node_stage_of_one_volume(sc: Client, shared: Driver) -> None:
    """NodeStageVolume idempotency under concurrency (a CO MAY issue simultaneous calls): every call
    answers OK (or ABORTED) and the volume ends up attached once and mounted once."""
    vol = create(sc)
    staging = str(shared.kubelet / uniq("staging"))
    os.makedirs(staging)
    codes: list[Any] = []
    barrier = threading.Barrier(6)

    def worker() -> None:
        barrier.wait()
        try:
            stage(sc, vol.volume_id, staging, mount_cap())
        except grpc.RpcError as e:
            codes.append(e.code())

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert set(codes) <= {ABORTED}, codes
        stage(sc, vol.volume_id, staging, mount_cap())
        assert len(loop_devices_under(backing_file(shared, vol.volume_id))) == 1
        with open("/proc/self/mountinfo") as f:
            assert sum(line.split()[4] == staging for line in f) == 1
    finally:
        unstage(sc, vol.volume_id, staging)
    assert not os.path.ismount(staging) and not loop_devices_under(backing_file(shared, vol.volume_id))


def test_node_unstage_required_fields_and_idempotency(sc: Client, shared: Driver) -> None:
    """NodeUnstageVolume: volume_id and staging_target_path are REQUIRED (INVALID_ARGUMENT); it MUST
    undo NodeStageVolume (nothing mounted or attached after) and be idempotent: a volume not staged
    there answers OK."""
    fails(
        INVALID,
        lambda: sc.node.NodeUnstageVolume(
            csi_pb2.NodeUnstageVolumeRequest(staging_target_path=str(shared.kubelet / "x"))
        ),
    )
    fails(INVALID, lambda: sc.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(volume_id="vol-x")))
    for path in ("relative", "/etc", f"{shared.kubelet}/../x", f"{shared.kubelet}/" + "p" * 5000):
        fails(INVALID, partial(unstage, sc, "vol-x", path))
    vol = create(sc)
    staging = str(shared.kubelet / uniq("staging"))
    unstage(sc, vol.volume_id, staging)  # never staged
    stage(sc, vol.volume_id, staging, mount_cap())
    for _ in range(2):
        unstage(sc, vol.volume_id, staging)
    assert not os.path.ismount(staging) and not loop_devices_under(backing_file(shared, vol.volume_id))


def test_node_unstage_at_a_path_where_the_volume_is_not_staged_is_ok(sc: Client, shared: Driver) -> None:
    """NodeUnstageVolume: a volume not staged to the given staging_target_path MUST answer OK, and
    its real staging is left as it is."""
    vol = create(sc)
    with staged(sc, shared, vol.volume_id, mount_cap()) as staging:
        elsewhere = str(shared.kubelet / uniq("elsewhere"))
        unstage(sc, vol.volume_id, elsewhere)
        assert os.path.ismount(staging)
        assert len(loop_devices_under(backing_file(shared, vol.volume_id))) == 1


# ==================================================================================================
# NodePublishVolume / NodeUnpublishVolume
# ==================================================================================================
@pytest.mark.parametrize("missing", ["volume_id", "target_path", "volume_capability", "access_mode"])
def test_node_publish_missing_required_fields(sc: Client, shared: Driver, missing: str) -> None:
    """NodePublishVolume: volume_id, target_path and volume_capability (with its access mode) are
    REQUIRED: INVALID_ARGUMENT."""
    vol = create(sc)
    kwargs: dict[str, Any] = {
        "volume_id": vol.volume_id,
        "staging_target_path": str(shared.kubelet / uniq("staging")),
        "target_path": target_path(shared),
        "volume_capability": mount_cap(),
    }
    _leave_out(kwargs, missing)
    fails(INVALID, lambda: sc.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(**kwargs)))


def test_node_publish_without_staging_target_path_fails_precondition(sc: Client, shared: Driver) -> None:
    """NodePublishVolume errors: with STAGE_UNSTAGE_VOLUME set, a request without a
    staging_target_path is FAILED_PRECONDITION (staging target path not set)."""
    vol = create(sc)
    fails(
        PRECONDITION,
        lambda: sc.node.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(
                volume_id=vol.volume_id, target_path=target_path(shared), volume_capability=mount_cap()
            )
        ),
    )


def test_node_publish_unknown_volume_is_not_found(sc: Client, shared: Driver) -> None:
    """NodePublishVolume errors: a volume that does not exist is NOT_FOUND."""
    fails(
        NOT_FOUND,
        lambda: publish(
            sc, "vol-does-not-exist", str(shared.kubelet / uniq("staging")), target_path(shared), mount_cap()
        ),
    )


def test_node_publish_before_stage_fails_precondition(sc: Client, shared: Driver) -> None:
    """NodePublishVolume: NodeStageVolume MUST have succeeded first; a volume that exists but is not
    staged there is FAILED_PRECONDITION."""
    vol = create(sc)
    fails(
        PRECONDITION,
        lambda: publish(
            sc, vol.volume_id, str(shared.kubelet / uniq("staging")), target_path(shared), mount_cap()
        ),
    )


def test_node_publish_idempotent_readonly_mismatch_and_unpublish_removes_target(
    sc: Client, shared: Driver
) -> None:
    """NodePublishVolume MUST be idempotent (same target, same arguments: OK); same target with
    another readonly flag is ALREADY_EXISTS. NodeUnpublishVolume MUST delete the directory it
    created and be idempotent; target paths outside the kubelet directory are INVALID_ARGUMENT."""
    vol = create(sc)
    with staged(sc, shared, vol.volume_id, mount_cap()) as staging:
        target = target_path(shared)
        for bad in (
            "relative/target",
            "/etc/target",
            f"{shared.kubelet}/../t",
            f"{shared.kubelet}/" + "t" * 5000,
        ):
            fails(INVALID, partial(publish, sc, vol.volume_id, staging, bad, mount_cap()))
        publish(sc, vol.volume_id, staging, target, mount_cap())
        publish(sc, vol.volume_id, staging, target, mount_cap())
        assert os.path.ismount(target)
        fails(ALREADY_EXISTS, lambda: publish(sc, vol.volume_id, staging, target, mount_cap(), readonly=True))
        for _ in range(2):
            unpublish(sc, vol.volume_id, target)
        assert not os.path.exists(target), "NodeUnpublishVolume MUST delete the directory it created"
        assert os.path.ismount(staging)


def test_node_publish_same_target_with_another_capability_is_refused(sc: Client, shared: Driver) -> None:
    """NodePublishVolume: a second call for the same target with other arguments (here another
    access mode) SHOULD be ALREADY_EXISTS (table: T1=T2, P1!=P2), or FAILED_PRECONDITION
    (a second call with a different volume_capability)."""
    cap = mount_cap(mode=Mode.SINGLE_NODE_MULTI_WRITER)
    vol = create(sc, cap=cap)
    with staged(sc, shared, vol.volume_id, cap) as staging:
        target = target_path(shared)
        publish(sc, vol.volume_id, staging, target, cap)
        other = mount_cap(mode=Mode.SINGLE_NODE_SINGLE_WRITER)
        fails((ALREADY_EXISTS, PRECONDITION), lambda: publish(sc, vol.volume_id, staging, target, other))


SECOND_TARGET = [
    (Mode.SINGLE_NODE_WRITER, PRECONDITION),
    (Mode.SINGLE_NODE_READER_ONLY, PRECONDITION),
    (Mode.SINGLE_NODE_SINGLE_WRITER, PRECONDITION),
    (Mode.SINGLE_NODE_MULTI_WRITER, None),
    (Mode.MULTI_NODE_READER_ONLY, None),
]


@pytest.mark.parametrize(("mode", "code"), SECOND_TARGET, ids=[Mode.Name(m) for m, _ in SECOND_TARGET])
def test_node_publish_second_target_by_access_mode(sc: Client, shared: Driver, mode: int, code: Any) -> None:
    """NodePublishVolume, second call on one node with another target_path (the table for plugins
    with SINGLE_NODE_MULTI_WRITER): OK for SINGLE_NODE_MULTI_WRITER and MULTI_NODE_*;
    FAILED_PRECONDITION for SINGLE_NODE_SINGLE_WRITER and every other non-MULTI_NODE mode."""
    cap = mount_cap(mode=mode)
    readonly = mode in (Mode.SINGLE_NODE_READER_ONLY, Mode.MULTI_NODE_READER_ONLY)
    vol = create(sc, cap=cap)
    if readonly:
        # An unformatted volume cannot be staged read-only: a writer formats it first.
        with staged(sc, shared, vol.volume_id, mount_cap()):
            pass
    with staged(sc, shared, vol.volume_id, cap) as staging:
        publish(sc, vol.volume_id, staging, target_path(shared), cap, readonly)
        second = target_path(shared)
        if code is None:
            publish(sc, vol.volume_id, staging, second, cap, readonly)
            assert os.path.ismount(second)
        else:
            fails(code, lambda: publish(sc, vol.volume_id, staging, second, cap, readonly))
            assert not os.path.ismount(second)


def test_readonly_filesystem_publish_is_not_writable(sc: Client, shared: Driver) -> None:
    """NodePublishVolume readonly: the SP MUST publish the volume read-only."""
    vol = create(sc)
    with staged(sc, shared, vol.volume_id, mount_cap()) as staging:
        target = target_path(shared)
        publish(sc, vol.volume_id, staging, target, mount_cap(), readonly=True)
        with pytest.raises(OSError) as info:
            Path(target, "written").write_bytes(b"x")
        assert info.value.errno == 30  # EROFS


def test_readonly_block_publish_is_not_writable(sc: Client, shared: Driver) -> None:
    """ControllerPublishVolume/NodePublishVolume readonly: the SP MUST publish the volume read-only;
    for a block volume no write through the device node may reach the volume."""
    vol = create(sc, cap=block_cap())
    ctx = controller_publish(sc, vol.volume_id, "node-a", block_cap(), readonly=True)
    written = False
    try:
        with staged(sc, shared, vol.volume_id, block_cap(), publish_context=ctx) as staging:
            target = target_path(shared)
            publish(sc, vol.volume_id, staging, target, block_cap(), readonly=True, publish_context=ctx)
            try:
                fd = os.open(target, os.O_RDWR)
                try:
                    os.pwrite(fd, b"w" * 4096, 0)
                    os.fsync(fd)
                    written = True
                finally:
                    os.close(fd)
            except OSError:
                pass
    finally:
        controller_unpublish(sc, vol.volume_id)
    with open(backing_file(shared, vol.volume_id), "rb") as f:
        head = f.read(4096)
    assert not written and head == bytes(4096), "a read-only block volume was written through its device node"


def test_node_unpublish_required_fields_and_idempotency(sc: Client, shared: Driver) -> None:
    """NodeUnpublishVolume: volume_id and target_path are REQUIRED (INVALID_ARGUMENT); MUST be
    idempotent: a target never published answers OK and is left alone."""
    fails(
        INVALID,
        lambda: sc.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(target_path=target_path(shared))
        ),
    )
    fails(INVALID, lambda: sc.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="vol-x")))
    vol = create(sc)
    bystander = shared.kubelet / uniq("bystander")
    bystander.mkdir()
    for _ in range(2):
        unpublish(sc, vol.volume_id, str(bystander))
    assert bystander.is_dir()


# ==================================================================================================
# NodeGetVolumeStats / NodeExpandVolume
# ==================================================================================================
def test_node_get_volume_stats(sc: Client, shared: Driver) -> None:
    """NodeGetVolumeStats: volume_id and volume_path are REQUIRED (INVALID_ARGUMENT); a volume that
    does not exist at volume_path is NOT_FOUND; usage values MUST NOT be negative and carry a unit;
    with VOLUME_CONDITION the response MUST carry a volume condition; any path where the volume is
    staged or published works."""
    vol = create(sc)
    stats_rpc = sc.node.NodeGetVolumeStats
    with staged(sc, shared, vol.volume_id, mount_cap()) as staging:
        target = target_path(shared)
        publish(sc, vol.volume_id, staging, target, mount_cap())
        fails(INVALID, lambda: stats_rpc(csi_pb2.NodeGetVolumeStatsRequest(volume_path=target)))
        fails(INVALID, lambda: stats_rpc(csi_pb2.NodeGetVolumeStatsRequest(volume_id=vol.volume_id)))
        fails(
            NOT_FOUND,
            lambda: stats_rpc(csi_pb2.NodeGetVolumeStatsRequest(volume_id="vol-nope", volume_path=target)),
        )
        for wrong in (str(shared.kubelet / "nowhere"), "/etc", "relative"):
            fails(
                (NOT_FOUND, INVALID),
                partial(
                    stats_rpc, csi_pb2.NodeGetVolumeStatsRequest(volume_id=vol.volume_id, volume_path=wrong)
                ),
            )
        for path in (target, staging):
            rsp = stats_rpc(
                csi_pb2.NodeGetVolumeStatsRequest(
                    volume_id=vol.volume_id, volume_path=path, staging_target_path=staging
                )
            )
            assert {u.unit for u in rsp.usage} <= {Unit.BYTES, Unit.INODES} and rsp.usage
            for u in rsp.usage:
                assert u.total > 0 and u.available >= 0 and u.used >= 0, u
            assert rsp.HasField("volume_condition") and rsp.volume_condition.message
            assert not rsp.volume_condition.abnormal


def test_node_expand_required_fields_and_not_found(sc: Client, shared: Driver) -> None:
    """NodeExpandVolume: volume_id and volume_path are REQUIRED (INVALID_ARGUMENT); a volume that
    does not exist (or is not available at volume_path) is NOT_FOUND."""
    vol = create(sc, cap=block_cap())
    node_expand = sc.node.NodeExpandVolume
    with staged(sc, shared, vol.volume_id, block_cap()) as staging:
        fails(INVALID, lambda: node_expand(csi_pb2.NodeExpandVolumeRequest(volume_path=staging)))
        fails(INVALID, lambda: node_expand(csi_pb2.NodeExpandVolumeRequest(volume_id=vol.volume_id)))
        fails(
            NOT_FOUND,
            lambda: node_expand(csi_pb2.NodeExpandVolumeRequest(volume_id="vol-nope", volume_path=staging)),
        )
        fails(
            NOT_FOUND,
            lambda: node_expand(
                csi_pb2.NodeExpandVolumeRequest(
                    volume_id=vol.volume_id, volume_path=str(shared.kubelet / "nowhere")
                )
            ),
        )


def test_node_expand_block_volume_is_idempotent(sc: Client, shared: Driver) -> None:
    """NodeExpandVolume MUST be idempotent and report the capacity after ControllerExpandVolume."""
    vol = create(sc, cap=block_cap())
    with staged(sc, shared, vol.volume_id, block_cap()) as staging:
        grown = expand(sc, vol.volume_id, required=2 * SIZE).capacity_bytes
        for _ in range(2):
            rsp = sc.node.NodeExpandVolume(
                csi_pb2.NodeExpandVolumeRequest(
                    volume_id=vol.volume_id,
                    volume_path=staging,
                    capacity_range=csi_pb2.CapacityRange(required_bytes=2 * SIZE),
                    volume_capability=block_cap(),
                )
            )
            assert rsp.capacity_bytes == grown
        # Block volumes: used and available MAY be omitted; the total is the device's size.
        stats = sc.node.NodeGetVolumeStats(
            csi_pb2.NodeGetVolumeStatsRequest(volume_id=vol.volume_id, volume_path=staging)
        )
        assert [(u.unit, u.total) for u in stats.usage] == [(Unit.BYTES, grown)]
        assert stats.HasField("volume_condition")


def test_node_expand_unsupported_capacity_range(sc: Client, shared: Driver) -> None:
    """NodeExpandVolume errors: a capacity_range the node cannot give (larger than the volume the
    controller made) is OUT_OF_RANGE, never OK with less; negative bounds are INVALID_ARGUMENT."""
    vol = create(sc, cap=block_cap())
    with staged(sc, shared, vol.volume_id, block_cap()) as staging:

        def node_expand(required: int) -> Any:
            return sc.node.NodeExpandVolume(
                csi_pb2.NodeExpandVolumeRequest(
                    volume_id=vol.volume_id,
                    volume_path=staging,
                    capacity_range=csi_pb2.CapacityRange(required_bytes=required),
                )
            )

        fails(OUT_OF_RANGE, lambda: node_expand(1 << 30))
        fails(INVALID, lambda: node_expand(-1))


def test_node_expand_unsupported_capability_is_invalid(sc: Client, shared: Driver) -> None:
    """NodeExpandVolume errors: a volume_capability the volume does not support is INVALID_ARGUMENT
    (exceeds capabilities)."""
    vol = create(sc, cap=block_cap())
    with staged(sc, shared, vol.volume_id, block_cap()) as staging:
        fails(
            INVALID,
            lambda: sc.node.NodeExpandVolume(
                csi_pb2.NodeExpandVolumeRequest(
                    volume_id=vol.volume_id, volume_path=staging, volume_capability=mount_cap("ntfs")
                )
            ),
        )


# ==================================================================================================
# Secrets
# ==================================================================================================
def test_secrets_are_never_echoed_or_logged(sc: Client, shared: Driver) -> None:
    """Secrets Requirements: secrets are sensitive and MUST NOT be logged or leaked, on success and
    on failure."""
    secret = f"s3cret-{uuid.uuid4().hex}"
    secrets = {SECRET_KEY: secret}
    vol = create(sc, secrets=secrets)
    errors = [
        fails(INVALID, lambda: create(sc, parameters={"bogus": "1"}, secrets=secrets)),
        fails(
            NOT_FOUND,
            lambda: sc.controller.ControllerPublishVolume(
                csi_pb2.ControllerPublishVolumeRequest(
                    volume_id=vol.volume_id,
                    node_id="node-unknown",
                    volume_capability=mount_cap(),
                    secrets=secrets,
                )
            ),
        ),
        fails(
            NOT_FOUND,
            lambda: sc.node.NodeStageVolume(
                csi_pb2.NodeStageVolumeRequest(
                    volume_id="vol-nope",
                    staging_target_path=str(shared.kubelet / uniq("staging")),
                    volume_capability=mount_cap(),
                    secrets=secrets,
                )
            ),
        ),
    ]
    sc.controller.CreateSnapshot(
        csi_pb2.CreateSnapshotRequest(name=uniq("s"), source_volume_id=vol.volume_id, secrets=secrets)
    )
    sc.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id, secrets=secrets))
    assert not [e.details() for e in errors if secret in (e.details() or "")]
    assert secret not in shared.log.read_text(errors="replace"), "a secret reached the driver's log"
