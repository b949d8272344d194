"""Property-based fuzzing of every CSI RPC of the Identity, Controller and Node services, through
real gRPC against a real `--mode all` driver process (root, loop devices, mounts).

Requests are generated from the proto descriptors, with the fields that reach the host drawn from
hostile values: ids and names with `..`, `/`, NUL, very long or non-UTF-8 bytes; paths into the
kubelet directory, through symlinks that lead into a fake `/etc`, outside it, relative, `..`,
NUL, 5000 bytes long; capabilities with odd filesystems and util-linux mount options;
capacities from negative to 2^63; parameters, contexts and secrets with the driver's own keys.

For every call:
- the reply is OK or a gRPC status other than UNKNOWN, and the driver logged no unexpected
  exception (an INTERNAL from a bug, rather than from a failing tool);
- the driver process is still alive;
- nothing outside the pool and the kubelet directory was created, changed or deleted: a canary
  directory (a fake `/etc`, files and symlink targets) stays byte-identical, every host path the
  fuzzer named is as it was, and no new mount point appeared outside the kubelet directory.

`KUBELOOP_FUZZ_EXAMPLES` sets the examples per RPC (default 50, which keeps the whole file under
a minute and a half); `KUBELOOP_FUZZ_EXAMPLES=2000 pytest tests/csi/test_fuzz.py` is a long run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller_runtime.mounts import read_mounts
from csi_driver.controller import CTX_BACKING_FILE, CTX_FS_TYPE, CTX_READONLY
from kubeloop_grpc.csi import csi_pb2

from .canary import snapshot_paths, snapshot_tree
from .conftest import Client, Driver, force_cleanup, loop_devices_under, teardown_volumes
from .volumes import block_cap, mount_cap

pytestmark = pytest.mark.root

EXAMPLES = int(os.environ.get("KUBELOOP_FUZZ_EXAMPLES", "50"))
MiB = 1 << 20
SERVICES = ("Identity", "Controller", "Node")
# Serialised requests carry this token where a string should be invalid UTF-8; it is swapped for
# bytes of the same length after serialisation (the Python client cannot encode such a string).
NON_UTF8_TOKEN = "NONUTF8TOKEN"
NON_UTF8_BYTES = b"\xff\xfe/\xc3(\xa0\xa1\xe2(\xa1\xf0\x00"
assert len(NON_UTF8_BYTES) == len(NON_UTF8_TOKEN)


@dataclass
class World:
    """The driver under fuzz and what it must not touch."""

    driver: Driver
    client: Client
    canary: Path
    volumes: list[str]
    snapshot: str
    kubelet: Path
    named: set[str] = field(default_factory=set)
    baseline_named: dict[str, Any] = field(default_factory=dict)
    baseline_canary: dict[str, Any] = field(default_factory=dict)
    baseline_mounts: set[str] = field(default_factory=set)
    calls: int = 0
    codes: dict[str, int] = field(default_factory=dict)


@pytest.fixture(scope="module")
def world(csi_root: Path) -> Iterator[World]:
    work = Path(tempfile.mkdtemp(prefix="fz", dir=csi_root))
    canary = work / "canary"  # outside both the pool and the kubelet directory
    (canary / "etc").mkdir(parents=True)
    (canary / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (canary / "etc" / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (canary / "data.img").write_bytes(b"\x00" * 4096)
    (canary / "dir").mkdir()
    d = Driver(work, "all", "node-z", ["--max-volume-size", "64Mi", "--max-volumes-per-node", "8"])
    d.kubelet.mkdir(parents=True)
    # Symlinks inside the kubelet directory that lead out of it, into the canary.
    os.symlink(canary / "etc", d.kubelet / "etc")
    os.symlink(canary / "etc" / "passwd", d.kubelet / "passwd")
    os.symlink(canary / "data.img", d.kubelet / "data.img")
    (d.kubelet / "pods" / "p1").mkdir(parents=True)
    os.symlink(canary / "dir", d.kubelet / "pods" / "p1" / "escape")
    os.symlink("../../../canary", d.kubelet / "pods" / "up")
    d.start()
    client = Client(d.endpoint)
    volumes = []
    for name, cap in (("fz-mount", mount_cap()), ("fz-block", block_cap()), ("fz-ro", mount_cap())):
        vol = client.controller.CreateVolume(
            csi_pb2.CreateVolumeRequest(
                name=name,
                capacity_range=csi_pb2.CapacityRange(required_bytes=16 * MiB),
                volume_capabilities=[cap],
            )
        ).volume
        client.controller.ControllerPublishVolume(
            csi_pb2.ControllerPublishVolumeRequest(
                volume_id=vol.volume_id, node_id="node-z", volume_capability=cap
            )
        )
        volumes.append(vol.volume_id)
    snap = client.controller.CreateSnapshot(
        csi_pb2.CreateSnapshotRequest(name="fz-snap", source_volume_id=volumes[0])
    )
    w = World(d, client, canary, volumes, snap.snapshot.snapshot_id, d.kubelet)
    w.baseline_canary = snapshot_tree(canary)
    w.baseline_mounts = {m.mountpoint for m in read_mounts()}
    try:
        yield w
    finally:
        try:
            if d.proc is not None and d.proc.poll() is None:
                teardown_volumes(client, d)
                cleanup_controller(client)
        finally:
            client.close()
            d.stop()
            force_cleanup(work)
        print(f"\nfuzz: {w.calls} calls, {EXAMPLES} examples per RPC; codes {dict(sorted(w.codes.items()))}")
        assert snapshot_tree(canary) == w.baseline_canary


def cleanup_controller(client: Client) -> None:
    """Deletes every snapshot and volume the fuzzer (or the fixture) created."""
    for entry in client.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest()).entries:
        client.controller.DeleteSnapshot(
            csi_pb2.DeleteSnapshotRequest(snapshot_id=entry.snapshot.snapshot_id)
        )
    for entry in client.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries:
        for node in entry.status.published_node_ids:
            client.controller.ControllerUnpublishVolume(
                csi_pb2.ControllerUnpublishVolumeRequest(volume_id=entry.volume.volume_id, node_id=node)
            )
        client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=entry.volume.volume_id))


# --- strategies ------------------------------------------------------------------------------------
def text(max_size: int = 40) -> st.SearchStrategy[str]:
    return st.text(st.characters(exclude_categories=["Cs"]), max_size=max_size)


HOSTILE = [
    "",
    ".",
    "..",
    "../../etc/passwd",
    "/etc/passwd",
    "a/b",
    "vol\x00x",
    ".hidden",
    "x" * 200,
    "x" * 5000,
    NON_UTF8_TOKEN,
    "vol-" + "0" * 32,
    "snap-" + "f" * 32,
    "node-z",
    "node-unknown",
    "é\u202eü",
]


def ids(w: World) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from([*w.volumes, w.snapshot, *HOSTILE]), text())


def paths(w: World) -> st.SearchStrategy[str]:
    k, c = str(w.kubelet), str(w.canary)
    fixed = [
        f"{k}/staging/a",
        f"{k}/staging/b",
        f"{k}/pods/p1/target",
        f"{k}/pods/p2/target/dev",
        f"{k}/etc",  # symlink to the canary's etc
        f"{k}/etc/newfile",
        f"{k}/etc/passwd",
        f"{k}/passwd",  # symlink to a canary file
        f"{k}/data.img",
        f"{k}/pods/p1/escape",
        f"{k}/pods/p1/escape/x",
        f"{k}/pods/up/etc",
        f"{k}/pods/up/dir/target",
        f"{k}/../canary/etc",
        f"{k}/./staging",
        f"{k}//staging//x/",
        k,
        f"{k}/",
        f"{k}x/escape",  # a sibling that only shares the prefix
        f"{c}/etc",
        f"{c}/etc/passwd",
        f"{c}/new",
        f"{c}/dir",
        "/etc",
        "/etc/passwd",
        "/etc/kubeloop-fuzz",
        "/",
        "/dev/null",
        "/proc/self/root/etc",
        "relative/path",
        "",
        f"{k}/a\x00b",
        f"{k}/{NON_UTF8_TOKEN}",
        f"{k}/" + "x" * 300,
        f"{k}/" + "/".join(["d" * 200] * 25),
        "/" + "x" * 5000,
    ]
    return st.one_of(
        st.sampled_from(fixed),
        st.builds(
            lambda parts: k + "/" + "/".join(parts),
            st.lists(
                st.sampled_from(["a", "..", ".", "etc", "pods", "escape", "x" * 255, "staging"]),
                min_size=1,
                max_size=5,
            ),
        ),
        text(60),
    )


def capacities() -> st.SearchStrategy[int]:
    return st.one_of(
        st.sampled_from(
            [0, 1, 4095, 4096, MiB, 16 * MiB, 64 * MiB, 64 * MiB + 1, 1 << 40, -1, -(1 << 63), (1 << 63) - 1]
        ),
        st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1),
    )


MOUNT_FLAGS = [
    "ro",
    "noatime",
    "discard",
    "loop",
    "offset=512",
    "bind",
    "rbind",
    "remount",
    "move",
    "X-mount.mkdir",
    "X-mount.owner=0",
    "x-systemd.automount",
    "helper=foo",
    "ro,bind",
    "data=journal",
    "nosuid\nx",
    "a\x00b",
    "context=system_u:object_r:etc_t:s0",
    NON_UTF8_TOKEN,
]
FS_TYPES = ["", "ext4", "xfs", "ext3", "ext2", "btrfs", "nfs", "../ext4", "ext4 -o", NON_UTF8_TOKEN]
CONTEXT_KEYS = [
    "csi.storage.k8s.io/fstype",
    "fsType",
    CTX_BACKING_FILE,
    CTX_READONLY,
    CTX_FS_TYPE,
    "csi.storage.k8s.io/pvc/name",
    "unknown",
    "",
]
CONTEXT_VALUES = [
    "ext4",
    "xfs",
    "true",
    "false",
    "../../../etc/passwd",
    "/etc/passwd",
    "volumes/x.img",
    "",
    NON_UTF8_TOKEN,
]


def dicts() -> st.SearchStrategy[dict[str, str]]:
    return st.dictionaries(
        st.one_of(st.sampled_from(CONTEXT_KEYS), text(20)),
        st.one_of(st.sampled_from(CONTEXT_VALUES), text(20)),
        max_size=4,
    )


def scalar(w: World, fd: FieldDescriptor) -> st.SearchStrategy[Any]:
    name = fd.name
    if fd.type == FieldDescriptor.TYPE_STRING:
        if name.endswith("_id") or name == "node_id":
            return ids(w)
        if name.endswith("path"):
            return paths(w)
        if name == "fs_type":
            return st.sampled_from(FS_TYPES)
        if name == "mount_flags":
            return st.one_of(st.sampled_from(MOUNT_FLAGS), text(20))
        if name == "name":
            return st.one_of(st.sampled_from(["fz-mount", "fz-new", *HOSTILE]), text())
        return st.one_of(st.sampled_from(HOSTILE), text())
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=32)
    if fd.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if fd.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in fd.enum_type.values] + [99])
    if fd.type in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return capacities()
    if fd.type in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return st.one_of(st.sampled_from([0, 1, 2, -1, 1000]), st.integers(-(1 << 31), (1 << 31) - 1))
    if fd.type in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.integers(0, (1 << 32) - 1)
    if fd.type in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.integers(0, (1 << 64) - 1)
    if fd.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=False, width=32)
    raise AssertionError(f"no strategy for {fd.full_name}")


def capabilities() -> st.SearchStrategy[csi_pb2.VolumeCapability]:
    """Well-formed capabilities, sometimes with hostile mount flags, so requests get past the
    first check and reach the host."""

    def with_flags(fs_type: str, flags: list[str]) -> csi_pb2.VolumeCapability:
        cap = mount_cap(fs_type)
        cap.mount.mount_flags.extend(flags)
        return cap

    return st.one_of(
        st.sampled_from([mount_cap(), mount_cap("ext4"), block_cap(), mount_cap("xfs")]),
        st.builds(
            with_flags, st.sampled_from(["", "ext4"]), st.lists(st.sampled_from(MOUNT_FLAGS), max_size=2)
        ),
    )


def message(w: World, desc: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """A message of type `desc` with any subset of its fields set (none past depth 4)."""
    cls = message_factory.GetMessageClass(desc)
    if depth > 4:
        return st.just(cls())
    if desc.full_name == "csi.v1.VolumeCapability":
        return st.one_of(capabilities(), _fields(w, desc, cls, depth))
    return _fields(w, desc, cls, depth)


def focused(w: World, desc: Descriptor) -> st.SearchStrategy[Any]:
    """A plausible request: real volume ids, this node, a well-formed capability and a small
    size, with the hostile values only where the host is reached (paths, mount flags), so the
    fuzzer gets to losetup, mkfs, mount and the path walk rather than stopping at the id check."""
    cls = message_factory.GetMessageClass(desc)
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for fd in desc.fields:
        name = fd.name
        if name in ("volume_id", "source_volume_id"):
            parts[name] = st.sampled_from(w.volumes)
        elif name == "snapshot_id":
            parts[name] = st.just(w.snapshot)
        elif name == "node_id":
            parts[name] = st.just("node-z")
        elif name == "name":
            parts[name] = st.sampled_from(["fz-a", "fz-b", "fz-mount"])
        elif name.endswith("path"):
            parts[name] = paths(w)
        elif name == "volume_capability":
            parts[name] = capabilities()
        elif name == "volume_capabilities":
            parts[name] = st.lists(capabilities(), min_size=1, max_size=2)
        elif name == "capacity_range":
            parts[name] = st.builds(
                lambda r: csi_pb2.CapacityRange(required_bytes=r),
                st.sampled_from([0, MiB, 16 * MiB, 32 * MiB]),
            )
        elif name == "readonly":
            parts[name] = st.booleans()
    return st.fixed_dictionaries(parts).map(lambda kw: _build(cls, kw))


def _fields(w: World, desc: Descriptor, cls: Any, depth: int) -> st.SearchStrategy[Any]:
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for fd in desc.fields:
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            parts[fd.name] = dicts()
            continue
        one = message(w, fd.message_type, depth + 1) if fd.message_type is not None else scalar(w, fd)
        parts[fd.name] = st.lists(one, max_size=3) if fd.is_repeated else one
    return st.fixed_dictionaries({}, optional=parts).map(lambda kw: _build(cls, kw))


def _build(cls: Any, kwargs: dict[str, Any]) -> Any:
    msg = cls()
    for key, value in kwargs.items():
        f = getattr(msg, key)
        if isinstance(value, dict):
            for k, v in value.items():
                f[k] = v
        elif isinstance(value, list):
            f.extend(value)
        elif hasattr(value, "SerializeToString"):
            f.CopyFrom(value)
        else:
            setattr(msg, key, value)
    return msg


# --- the property --------------------------------------------------------------------------------
RPCS = [
    (service.name, method)
    for service in csi_pb2.DESCRIPTOR.services_by_name.values()
    if service.name in SERVICES
    for method in service.methods
]


def host_paths(w: World, request: Any) -> set[str]:
    """Absolute paths the request named that lie outside the kubelet directory and the pool,
    plus their parents: these must not change."""
    named = set()
    for fd, value in request.ListFields():
        values = value if fd.is_repeated else [value]
        for v in values:
            if isinstance(v, str) and v.startswith("/") and "\x00" not in v and NON_UTF8_TOKEN not in v:
                p = os.path.normpath(v)
                for q in (p, os.path.dirname(p)):
                    if not q.startswith(
                        (str(w.kubelet) + "/", str(w.driver.pool) + "/", str(w.driver.state) + "/")
                    ):
                        named.add(q)
    return named


def call(w: World, service: str, method: Any, request: Any) -> grpc.StatusCode:
    raw = request.SerializeToString()
    raw = raw.replace(NON_UTF8_TOKEN.encode(), NON_UTF8_BYTES)
    output = message_factory.GetMessageClass(method.output_type)
    stub = w.client.channel.unary_unary(
        f"/csi.v1.{service}/{method.name}", request_serializer=None, response_deserializer=output.FromString
    )
    try:
        stub(raw, timeout=60)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def mounts_outside(w: World) -> list[str]:
    """New mount points outside the kubelet directory that are this driver's doing: under the
    fuzz directory (the canary), on a host path the fuzzer named, or of one of the loop devices of
    this driver's pool, wherever it is (every mount the driver makes is one of these, a bind of a
    staged filesystem included). Other tests on the host mount their own things meanwhile."""
    devices = {os.path.basename(d) for d in loop_devices_under(w.driver.pool)}
    kubelet = str(w.kubelet) + "/"
    found = []
    for m in read_mounts():
        if m.mountpoint in w.baseline_mounts or m.mountpoint.startswith(kubelet):
            continue
        ours = (
            m.mountpoint.startswith(str(w.driver.root) + "/")
            or m.mountpoint in w.baseline_named
            or os.path.basename(m.source) in devices
            or os.path.basename(m.root) in devices
        )
        if ours:
            found.append(m.mountpoint)
    return found


def checked_call(w: World, service: str, method: Any, request: Any) -> grpc.StatusCode:
    """One RPC, then every invariant of the module docstring."""
    named = host_paths(w, request) - set(w.baseline_named)
    w.baseline_named.update(snapshot_paths(named))
    log_size = w.driver.log.stat().st_size
    code = call(w, service, method, request)
    w.calls += 1
    key = f"{method.name}:{code.name}"
    w.codes[key] = w.codes.get(key, 0) + 1
    assert w.driver.proc is not None and w.driver.proc.poll() is None, "the driver died"
    assert code != grpc.StatusCode.UNKNOWN, f"{method.name} answered UNKNOWN to {request!r}"
    with open(w.driver.log, "rb") as f:
        f.seek(log_size)
        new_log = f.read().decode(errors="replace")
    assert "unexpected error" not in new_log, f"{method.name}: unhandled exception for {request!r}\n{new_log}"
    assert snapshot_paths(set(w.baseline_named)) == w.baseline_named, f"{method.name} changed host paths"
    assert snapshot_tree(w.canary) == w.baseline_canary, f"{method.name} changed the canary: {request!r}"
    outside = mounts_outside(w)
    assert not outside, f"{method.name} mounted {outside} outside the kubelet directory: {request!r}"
    return code


@pytest.mark.parametrize(("service", "method"), RPCS, ids=[m.name for _, m in RPCS])
def test_fuzz_rpc(world: World, service: str, method: Any) -> None:
    w = world

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(request=st.one_of(message(w, method.input_type), focused(w, method.input_type)))
    def prop(request: Any) -> None:
        checked_call(w, service, method, request)

    prop()


NODE = csi_pb2.DESCRIPTOR.services_by_name["Node"].methods_by_name


def test_fuzz_node_lifecycle(world: World) -> None:
    """Stage, publish, stats, expand, unpublish, unstage in order on a real volume, with generated
    paths and capabilities: gets past the state checks to the walk, the mounts and the removals."""
    w = world

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        index=st.integers(0, len(w.volumes) - 1),
        staging=paths(w),
        target=paths(w),
        cap=capabilities(),
        readonly=st.booleans(),
    )
    def prop(index: int, staging: str, target: str, cap: csi_pb2.VolumeCapability, readonly: bool) -> None:
        vid = w.volumes[index]
        if index == 1:  # the block volume
            cap = block_cap()
        steps = [
            (
                "NodeStageVolume",
                csi_pb2.NodeStageVolumeRequest(
                    volume_id=vid, staging_target_path=staging, volume_capability=cap
                ),
            ),
            (
                "NodePublishVolume",
                csi_pb2.NodePublishVolumeRequest(
                    volume_id=vid,
                    staging_target_path=staging,
                    target_path=target,
                    volume_capability=cap,
                    readonly=readonly,
                ),
            ),
            ("NodeGetVolumeStats", csi_pb2.NodeGetVolumeStatsRequest(volume_id=vid, volume_path=target)),
            ("NodeExpandVolume", csi_pb2.NodeExpandVolumeRequest(volume_id=vid, volume_path=target)),
            ("NodeUnpublishVolume", csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path=target)),
            (
                "NodeUnstageVolume",
                csi_pb2.NodeUnstageVolumeRequest(volume_id=vid, staging_target_path=staging),
            ),
        ]
        for name, request in steps:
            checked_call(w, "Node", NODE[name], request)

    prop()
