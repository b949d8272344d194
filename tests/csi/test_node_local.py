"""`--mode all --node-local`: each node's driver serves its own pool, controller and node service
together (real loop devices, mounts and processes, root). A volume is accessible from its node
only; GetCapacity answers per topology segment; clones and restores are made where the source is;
the node stages without ControllerPublishVolume (CSIDriver attachRequired: false) and cleans up
after itself; two nodes never see each other's volumes; a pool-less start says why; a kill -9 in
the middle of a create converges."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from csi_driver import TOPOLOGY_KEY
from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc
from tests.support.waits import eventually

from .conftest import REPO, Client, Driver, loop_devices_under, mounts_under
from .processes import free_port, kill_during_clone, readyz, running, wait_serving
from .volumes import MiB, Mode, block_cap, create, mount_cap, read_digest, write_data

pytestmark = pytest.mark.root

Code = grpc.StatusCode


def segment(node: str) -> csi_pb2.Topology:
    return csi_pb2.Topology(segments={TOPOLOGY_KEY: node})


def local_driver(csi_root: Path, node: str, *extra: str, make_pool: bool = True) -> Driver:
    """A node-local driver for `node` in a directory of its own (its own pool, state and socket),
    launched but not waited for; a node-local pool is never made by the driver, so the test makes
    it unless it tests its absence."""
    work = Path(tempfile.mkdtemp(prefix="nl", dir=csi_root))
    d = Driver(work, "all", node, ["--node-local", *extra])
    if make_pool:
        d.pool.mkdir()
    return d.launch()


def fails(code: grpc.StatusCode, call: Callable[[], object], *words: str) -> str:
    """Runs `call`, which must fail with `code` and a message holding every one of `words`."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    message = err.details() or ""
    for word in words:
        assert word in message, f"{word!r} missing from the message {message!r}"
    return message


def capacity(client: Client, topology: csi_pb2.Topology | None = None) -> int:
    req = csi_pb2.GetCapacityRequest(volume_capabilities=[mount_cap()])
    if topology is not None:
        req.accessible_topology.CopyFrom(topology)
    return int(client.controller.GetCapacity(req).available_capacity)


def volume_source(volume_id: str) -> csi_pb2.VolumeContentSource:
    return csi_pb2.VolumeContentSource(volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=volume_id))


def snapshot_source(snapshot_id: str) -> csi_pb2.VolumeContentSource:
    return csi_pb2.VolumeContentSource(
        snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snapshot_id)
    )


# --- flags ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["node", "controller"])
def test_node_local_needs_mode_all(mode: str) -> None:
    """A node-local pool is served by one process per node: any other mode is a usage error."""
    proc = subprocess.run(
        [sys.executable, "-m", "csi_driver.main", "--mode", mode, "--node-local"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--node-local requires --mode all" in proc.stderr and f"--mode {mode}" in proc.stderr


# --- topology -------------------------------------------------------------------------------------
def test_volumes_are_accessible_from_their_node_only(csi_root: Path) -> None:
    """Without requirements, with a requisite list holding this node among others, with preferred
    topologies only: the volume's topology is this node alone. A requisite (or, without one, a
    preferred) list that leaves this node out is the spec's RESOURCE_EXHAUSTED naming the node."""
    d = local_driver(csi_root, "node-1")
    with running(d) as (client,):
        own = [{TOPOLOGY_KEY: "node-1"}]
        plain = create(client, "plain", size=16 * MiB)
        assert [dict(t.segments) for t in plain.accessible_topology] == own
        among = [segment("node-2"), segment("node-1"), segment("node-3")]
        vol = create(
            client,
            "among",
            size=16 * MiB,
            accessibility_requirements=csi_pb2.TopologyRequirement(requisite=among, preferred=among[:1]),
        )
        assert [dict(t.segments) for t in vol.accessible_topology] == own
        vol = create(
            client,
            "preferred",
            size=16 * MiB,
            accessibility_requirements=csi_pb2.TopologyRequirement(preferred=[segment("node-1")]),
        )
        assert [dict(t.segments) for t in vol.accessible_topology] == own
        for name, reqs in (
            ("requisite-elsewhere", csi_pb2.TopologyRequirement(requisite=[segment("node-2")])),
            ("preferred-elsewhere", csi_pb2.TopologyRequirement(preferred=[segment("node-2")])),
            (
                "foreign-key",
                csi_pb2.TopologyRequirement(
                    requisite=[csi_pb2.Topology(segments={"kubernetes.io/hostname": "node-1"})]
                ),
            ),
        ):
            fails(
                Code.RESOURCE_EXHAUSTED,
                lambda r=reqs, n=name: create(client, n, size=16 * MiB, accessibility_requirements=r),  # type: ignore[misc]
                "node-1",
                "node-local",
            )
        listed = client.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries
        assert len(listed) == 3, "a refused create left a volume behind"
        assert len(list((d.pool / "volumes").iterdir())) == 3


def test_get_capacity_answers_for_this_nodes_segment_only(csi_root: Path) -> None:
    """GetCapacity: the pool's free room for no segment and for this node's; 0 for another node's
    segment or a key this driver does not know."""
    with running(local_driver(csi_root, "node-1", "--capacity", "100Mi")) as (client,):
        assert capacity(client) == 100 * MiB
        assert capacity(client, segment("node-1")) == 100 * MiB
        assert capacity(client, segment("node-2")) == 0
        assert capacity(client, csi_pb2.Topology(segments={"kubernetes.io/hostname": "node-1"})) == 0
        create(client, "room", size=40 * MiB)
        assert capacity(client, segment("node-1")) == 60 * MiB


# --- clones and restores ---------------------------------------------------------------------------
def test_clones_and_restores_are_made_on_the_source_node(csi_root: Path) -> None:
    """A source this node's pool holds is cloned and restored here, the copy accessible from this
    node; a source another node holds is NOT_FOUND saying where copies are made; a source held here
    with a topology that excludes this node is RESOURCE_EXHAUSTED."""
    with running(local_driver(csi_root, "node-1"), local_driver(csi_root, "node-2")) as (one, two):
        source = create(one, "source", size=32 * MiB)
        snap = one.controller.CreateSnapshot(
            csi_pb2.CreateSnapshotRequest(name="snap", source_volume_id=source.volume_id)
        ).snapshot
        for name, src in (
            ("clone", volume_source(source.volume_id)),
            ("restore", snapshot_source(snap.snapshot_id)),
        ):
            copy = create(one, name, volume_content_source=src)
            assert [dict(t.segments) for t in copy.accessible_topology] == [{TOPOLOGY_KEY: "node-1"}]
            fails(
                Code.NOT_FOUND,
                lambda s=src, n=name: create(two, n, volume_content_source=s),  # type: ignore[misc]
                "node-2",
                "node-local volumes are cloned and restored on the node that holds the source",
            )
            fails(
                Code.RESOURCE_EXHAUSTED,
                lambda s=src, n=name: create(  # type: ignore[misc]
                    one,
                    f"{n}-elsewhere",
                    volume_content_source=s,
                    accessibility_requirements=csi_pb2.TopologyRequirement(requisite=[segment("node-2")]),
                ),
                "node-1",
            )
        assert not two.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries


# --- stage and publish without ControllerPublishVolume -----------------------------------------------
class Unpublished:
    """Stage and publish as kubelet does for a CSIDriver with attachRequired: false: no
    ControllerPublishVolume, no publish context."""

    def __init__(
        self, client: Client, driver: Driver, volume_id: str, cap: csi_pb2.VolumeCapability, name: str
    ) -> None:
        self.client, self.volume_id, self.cap = client, volume_id, cap
        self.staging = str(driver.kubelet / f"staging-{name}")
        self.target = str(driver.kubelet / f"target-{name}" / "mount")
        os.makedirs(self.staging, exist_ok=True)
        os.makedirs(os.path.dirname(self.target), exist_ok=True)

    def stage(self) -> None:
        self.client.node.NodeStageVolume(
            csi_pb2.NodeStageVolumeRequest(
                volume_id=self.volume_id, staging_target_path=self.staging, volume_capability=self.cap
            )
        )

    def publish(self, readonly: bool = False) -> None:
        self.client.node.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(
                volume_id=self.volume_id,
                staging_target_path=self.staging,
                target_path=self.target,
                volume_capability=self.cap,
                readonly=readonly,
            )
        )

    def close(self) -> None:
        self.client.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=self.volume_id, target_path=self.target)
        )
        self.client.node.NodeUnstageVolume(
            csi_pb2.NodeUnstageVolumeRequest(volume_id=self.volume_id, staging_target_path=self.staging)
        )


def device_digest(path: str, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(size)).hexdigest()


def write_device(path: str, size: int) -> str:
    data = hashlib.shake_256(b"node-local").digest(size)
    with open(path, "r+b") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def test_stage_and_publish_without_a_publish_context(csi_root: Path) -> None:
    """kubelet never calls ControllerPublishVolume for this driver in node-local mode: stage and
    publish find the backing file, access type and filesystem in the node's own record. Mount and
    block, read-write, then read-only by the publish's readonly flag and by a reader-only mode; the
    controller never records a publication; a staged volume is not deleted, and a staged block
    volume's expansion goes to the node. Afterwards no loop device, mount or backing file is left."""
    d = local_driver(csi_root, "node-1")
    with running(d) as (client,):
        fs_vol = create(client, "fs", size=64 * MiB)
        block_vol = create(client, "raw", size=16 * MiB, cap=block_cap())
        writer = Unpublished(client, d, fs_vol.volume_id, mount_cap(), "fs")
        writer.stage()
        writer.publish()
        digest = write_data(writer.target)
        assert (
            client.controller.ControllerGetVolume(
                csi_pb2.ControllerGetVolumeRequest(volume_id=fs_vol.volume_id)
            ).status.published_node_ids
            == []
        )
        fails(
            Code.FAILED_PRECONDITION,
            lambda: client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=fs_vol.volume_id)),
            "still staged on node node-1",
        )
        writer.close()
        for name, cap, readonly in (
            ("fs-ro-flag", mount_cap(), True),
            ("fs-ro-mode", mount_cap(mode=Mode.SINGLE_NODE_READER_ONLY), False),
        ):
            reader = Unpublished(client, d, fs_vol.volume_id, cap, name)
            reader.stage()
            reader.publish(readonly=readonly)
            assert read_digest(reader.target) == digest
            with pytest.raises(OSError):
                write_data(reader.target, seed=b"refused")
            reader.close()

        raw = Unpublished(client, d, block_vol.volume_id, block_cap(), "raw")
        fails(
            Code.FAILED_PRECONDITION,
            lambda: Unpublished(client, d, block_vol.volume_id, mount_cap(), "raw-as-fs").stage(),
            "block volume",
        )
        raw.stage()
        raw.publish()
        block_digest = write_device(raw.target, 4 * MiB)
        grown = client.controller.ControllerExpandVolume(
            csi_pb2.ControllerExpandVolumeRequest(
                volume_id=block_vol.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=32 * MiB)
            )
        )
        assert grown.node_expansion_required, "a staged block volume's loop device must be refreshed"
        raw.close()
        for name, cap, readonly in (
            ("raw-ro-flag", block_cap(), True),
            ("raw-ro-mode", block_cap(mode=Mode.SINGLE_NODE_READER_ONLY), False),
        ):
            reader = Unpublished(client, d, block_vol.volume_id, cap, name)
            reader.stage()
            reader.publish(readonly=readonly)
            assert device_digest(reader.target, 4 * MiB) == block_digest
            with pytest.raises(OSError):
                write_device(reader.target, 4096)
            reader.close()

        for vol in (fs_vol, block_vol):
            client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
        fails(Code.NOT_FOUND, lambda: writer.stage(), fs_vol.volume_id, "node-1")
        assert not loop_devices_under(d.root), "a loop device is left"
        assert not mounts_under(d.root), "a mount is left"
        assert not list((d.pool / "volumes").iterdir()), "a backing file is left"
        assert not list((d.state / "staging").iterdir()), "a staging record is left"


# --- two nodes --------------------------------------------------------------------------------------
def test_two_nodes_never_see_each_others_volumes(csi_root: Path) -> None:
    """Two node-local drivers on separate pools, as two machines: neither lists, stages, clones nor
    deletes the other's volume."""
    a, b = local_driver(csi_root, "node-a"), local_driver(csi_root, "node-b")
    with running(a, b) as (one, two):
        vol = create(one, "mine", size=16 * MiB)
        backing = a.pool / "volumes" / f"{vol.volume_id}.img"
        assert backing.exists() and not list((b.pool / "volumes").iterdir())
        assert not two.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries
        fails(
            Code.NOT_FOUND,
            lambda: two.controller.ControllerGetVolume(
                csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id)
            ),
        )
        fails(
            Code.NOT_FOUND,
            lambda: Unpublished(two, b, vol.volume_id, mount_cap(), "theirs").stage(),
            "node-b",
        )
        # The other node's DeleteVolume is the spec's idempotent OK for a volume it does not have,
        # and must not touch this node's file.
        two.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
        assert backing.exists()
        assert capacity(one, segment("node-b")) == 0 and capacity(two, segment("node-a")) == 0
        assert capacity(one, segment("node-a")) > 0 and capacity(two, segment("node-b")) > 0
        # A group snapshot of volumes on two nodes: refused, naming the other node's, nothing copied.
        theirs = create(two, "theirs", size=16 * MiB)
        group = csi_pb2_grpc.GroupControllerStub(one.channel)
        req = csi_pb2.CreateVolumeGroupSnapshotRequest(
            name="across", source_volume_ids=[vol.volume_id, theirs.volume_id]
        )
        fails(
            Code.FAILED_PRECONDITION,
            lambda: group.CreateVolumeGroupSnapshot(req),
            theirs.volume_id,
            "must all be on one node",
        )
        assert not list((a.pool / "snapshots").iterdir())


def test_no_controller_publish_is_advertised_nor_served(csi_root: Path) -> None:
    """A node-local volume is never ControllerPublished (CSIDriver attachRequired: false), so the
    controller does not advertise PUBLISH_UNPUBLISH_VOLUME nor the capabilities that come with it,
    as csi-driver-host-path without --enable-attach: a sidecar that sees it (the provisioner's
    deletion check, beside the driver on every node) would otherwise cache every VolumeAttachment of
    the cluster on every node. A publish anyway is UNIMPLEMENTED and records nothing, so it can
    never hold back a DeleteVolume."""
    d = local_driver(csi_root, "node-a")
    with running(d) as (client,):
        rsp = client.controller.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest())
        caps = {c.rpc.type for c in rsp.capabilities}
        rpc = csi_pb2.ControllerServiceCapability.RPC
        assert rpc.CREATE_DELETE_VOLUME in caps and rpc.GET_CAPACITY in caps
        for publishing in (
            rpc.PUBLISH_UNPUBLISH_VOLUME,
            rpc.LIST_VOLUMES_PUBLISHED_NODES,
            rpc.PUBLISH_READONLY,
        ):
            assert publishing not in caps, rpc.Type.Name(publishing)
        vol = create(client, "mine", size=16 * MiB)
        fails(
            Code.UNIMPLEMENTED,
            lambda: client.controller.ControllerPublishVolume(
                csi_pb2.ControllerPublishVolumeRequest(
                    volume_id=vol.volume_id, node_id="node-a", volume_capability=mount_cap()
                )
            ),
            "attachRequired",
        )
        fails(
            Code.UNIMPLEMENTED,
            lambda: client.controller.ControllerUnpublishVolume(
                csi_pb2.ControllerUnpublishVolumeRequest(volume_id=vol.volume_id, node_id="node-a")
            ),
            "attachRequired",
        )
        client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
        assert not list((d.pool / "volumes").iterdir())


# --- a pool-less start --------------------------------------------------------------------------------
@contextlib.contextmanager
def read_only_bind(path: Path) -> Iterator[None]:
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("problem", ["missing", "not-a-directory", "read-only"])
def test_a_pool_less_start_serves_unhealthy_and_says_why(csi_root: Path, problem: str) -> None:
    """A node plugin whose --pool-dir is missing, not a directory or read-only keeps running and
    says why everywhere a CO or an operator looks: Probe is FAILED_PRECONDITION (the spec's "not
    healthy", which the livenessprobe reports), /readyz fails naming it, GetCapacity is 0 and
    CreateVolume is RESOURCE_EXHAUSTED (a WaitForFirstConsumer claim is rescheduled to another
    node) naming the cause; nothing is created anywhere."""
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="nl", dir=csi_root))
    d = Driver(work, "all", "node-1", ["--node-local", "--http-endpoint", f"127.0.0.1:{port}"])
    expected = {
        "missing": "does not exist",
        "not-a-directory": "is not a directory",
        "read-only": "Read-only",
    }[problem]
    with contextlib.ExitStack() as stack:
        if problem == "not-a-directory":
            d.pool.write_text("a file, not a pool")
        elif problem == "read-only":
            d.pool.mkdir()
            stack.enter_context(read_only_bind(d.pool))
        d.launch()
        try:
            wait_serving(d)
            client = Client(d.endpoint)
            stack.callback(client.close)
            fails(Code.FAILED_PRECONDITION, lambda: client.identity.Probe(csi_pb2.ProbeRequest()), expected)
            status, body = readyz(port)
            assert status >= 500 and expected in body, (status, body)
            assert capacity(client) == 0 and capacity(client, segment("node-1")) == 0
            fails(
                Code.RESOURCE_EXHAUSTED, lambda: create(client, "nowhere", size=16 * MiB), "node-1", expected
            )
            assert d.proc is not None and d.proc.poll() is None, "the plugin exited"
        finally:
            assert d.stop() == 0
    if problem == "missing":
        assert not d.pool.exists(), "a node-local pool was made where the admin's disk should be"
    elif problem == "read-only":
        assert sorted(p.name for p in d.pool.iterdir()) == []
    assert not list((d.state / "volumes").iterdir())


def test_an_unmounted_pool_disk_is_not_replaced_by_an_empty_directory(csi_root: Path) -> None:
    """The pool's disk not mounted at a restart leaves its mount point, an empty directory, where
    the pool was. The driver's records say volumes live there, so it is not a new pool: the plugin
    serves unhealthy saying so, makes nothing in that directory (new volumes would land on the root
    filesystem and vanish under the disk once it is mounted), and a DeleteVolume neither succeeds
    nor forgets the volume (its backing file on the disk would be left for good). With the disk
    back, the volume is there and is deleted."""
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="nl", dir=csi_root))
    d = Driver(work, "all", "node-1", ["--node-local", "--http-endpoint", f"127.0.0.1:{port}"])
    d.pool.mkdir()
    disk = work / "disk"
    with running(d.launch()) as (client,):
        vol = create(client, "kept", size=16 * MiB)
    d.pool.rename(disk)  # the disk's file system, not mounted
    d.pool.mkdir()  # its empty mount point
    with contextlib.ExitStack() as stack:
        d.launch()
        try:
            wait_serving(d)
            client = Client(d.endpoint)
            stack.callback(client.close)
            expected = "is the pool's disk mounted?"
            fails(Code.FAILED_PRECONDITION, lambda: client.identity.Probe(csi_pb2.ProbeRequest()), expected)
            status, body = readyz(port)
            assert status >= 500 and expected in body, (status, body)
            fails(Code.RESOURCE_EXHAUSTED, lambda: create(client, "lost", size=16 * MiB), expected)
            fails(
                Code.FAILED_PRECONDITION,
                lambda: client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id)),
                vol.volume_id,
                expected,
            )
            assert list(d.pool.iterdir()) == [], "the empty mount point was written to"
        finally:
            assert d.stop() == 0
    d.pool.rmdir()
    disk.rename(d.pool)  # mounted again
    with running(d.launch()) as (client,):
        client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
        assert not list((d.pool / "volumes").iterdir())


# --- kill -9 --------------------------------------------------------------------------------------
def test_kill9_mid_create_converges(csi_root: Path) -> None:
    """kill -9 while a clone copies (its record written, not ready): the restarted node-local
    driver rolls it back, so no backing file is left that no volume owns; the retry by name makes
    it on this node."""
    d = local_driver(csi_root, "node-1")
    with running(d) as (client,):
        requisite = csi_pb2.TopologyRequirement(requisite=[segment("node-1")])
        source, request = kill_during_clone(d, client, "big", "killed", accessibility_requirements=requisite)
        d.start()
        files = {p.name.removesuffix(".img") for p in (d.pool / "volumes").iterdir()}
        assert files == {source.volume_id}, f"leaked backing files: {files - {source.volume_id}}"
        made = client.controller.CreateVolume(request).volume
        assert [dict(t.segments) for t in made.accessible_topology] == [{TOPOLOGY_KEY: "node-1"}]
        files = {p.name.removesuffix(".img") for p in (d.pool / "volumes").iterdir()}
        assert files == {source.volume_id, made.volume_id}


# --- pool kinds -----------------------------------------------------------------------------------
def test_pool_kinds_are_chosen_by_the_class_parameter_kind(csi_root: Path) -> None:
    """`--capacity fast=100Mi --capacity slow=50Mi`: GetCapacity answers per kind; a volume, and
    a snapshot of it, take from their kind's budget only; a kind the node does not have, or none,
    is INVALID_ARGUMENT naming the kinds it has, for GetCapacity and CreateVolume alike.
    Restarted without a kind, its volumes cannot grow, and the answer says why."""
    flags = ("--capacity", "fast=100Mi", "--capacity", "slow=50Mi")
    d = local_driver(csi_root, "node-1", *flags)
    with running(d) as (client,):

        def room(kind: str | None, topology: csi_pb2.Topology | None = None) -> int:
            req = csi_pb2.GetCapacityRequest(
                volume_capabilities=[mount_cap()], parameters={} if kind is None else {"kind": kind}
            )
            if topology is not None:
                req.accessible_topology.CopyFrom(topology)
            return int(client.controller.GetCapacity(req).available_capacity)

        assert (room("fast"), room("slow")) == (100 * MiB, 50 * MiB)
        fails(Code.INVALID_ARGUMENT, lambda: room("medium"), "'medium' is unknown", "fast, slow")
        fails(Code.INVALID_ARGUMENT, lambda: room(None), "fast, slow", "'kind'")
        assert room("fast", segment("node-1")) == 100 * MiB and room("fast", segment("node-2")) == 0
        vol = create(client, "quick", size=40 * MiB, parameters={"kind": "fast"})
        client.controller.CreateSnapshot(
            csi_pb2.CreateSnapshotRequest(name="quick-snap", source_volume_id=vol.volume_id)
        )
        assert (room("fast"), room("slow")) == (20 * MiB, 50 * MiB)
        fails(
            Code.RESOURCE_EXHAUSTED,
            lambda: create(client, "big", size=30 * MiB, parameters={"kind": "fast"}),
            "fast",
        )
        create(client, "bulk", size=30 * MiB, parameters={"kind": "slow"})
        assert (room("fast"), room("slow")) == (20 * MiB, 20 * MiB)
        fails(
            Code.INVALID_ARGUMENT,
            lambda: create(client, "medium", parameters={"kind": "medium"}),
            "fast, slow",
        )
        fails(Code.INVALID_ARGUMENT, lambda: create(client, "unkind"), "fast, slow", "'kind'")
        fails(
            Code.ALREADY_EXISTS,
            lambda: create(client, "quick", size=40 * MiB, parameters={"kind": "slow"}),
            "pool kind is fast",
        )
        d.stop()
        d.extra = ["--node-local", "--capacity", "slow=50Mi"]
        d.start()
        grow = csi_pb2.ControllerExpandVolumeRequest(
            volume_id=vol.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=48 * MiB)
        )
        fails(
            Code.OUT_OF_RANGE, lambda: client.controller.ControllerExpandVolume(grow), "no longer configures"
        )
        assert room("slow") == 20 * MiB
        fails(Code.INVALID_ARGUMENT, lambda: room("fast"), "'fast' is unknown")


def test_capacity_sizes_with_and_without_a_kind_do_not_mix() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "csi_driver.main", "--capacity", "1Gi", "--capacity", "fast=1Gi"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "do not mix" in proc.stderr, proc.stderr


def test_kill9_during_a_burst_of_creates_leaves_no_leak_and_no_duplicate(csi_root: Path) -> None:
    """30 CreateVolumes at once on a node-local driver, kill -9 while they run: after the restart
    the retries by name make each volume exactly once, and the pool holds a file for each volume
    and nothing else."""
    d = local_driver(csi_root, "node-1", "--capacity", "1Gi")
    names = [f"burst-{i}" for i in range(30)]
    with running(d) as (client,):
        interrupted: list[str] = []

        def make(name: str) -> None:
            try:
                create(client, name, size=16 * MiB, accessibility_requirements=_own_node("node-1"))
            except grpc.RpcError:
                interrupted.append(name)

        threads = [threading.Thread(target=make, args=(n,)) for n in names]
        for t in threads:
            t.start()
        records = d.state / "volumes"
        eventually("the burst's first records", lambda: len(list(records.glob("*.json"))) >= 5, 20, 0.001)
        d.kill9()
        for t in threads:
            t.join()
        assert interrupted, "every create finished before the kill"
        d.start()
        made = {
            n: create(client, n, size=16 * MiB, accessibility_requirements=_own_node("node-1")) for n in names
        }
        again = {n: create(client, n, size=16 * MiB).volume_id for n in names}
        assert {n: v.volume_id for n, v in made.items()} == again, "a retry made a second volume"
        ids = set(again.values())
        assert len(ids) == 30
        listed = {
            e.volume.volume_id for e in client.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries
        }
        files = {p.name.removesuffix(".img") for p in (d.pool / "volumes").iterdir()}
        assert listed == ids and files == ids, f"leaked: {files - ids}, missing: {ids - files}"
        assert capacity(client) == 1024 * MiB - 30 * 16 * MiB


def _own_node(node: str) -> csi_pb2.TopologyRequirement:
    return csi_pb2.TopologyRequirement(requisite=[segment(node)], preferred=[segment(node)])
