"""The pool's gauges on the driver's /metrics (csi_driver.pool_metrics), scraped from real driver
processes on real loop devices and mounts (root). Each pool is a tmpfs of its own, so its
filesystem's size and free bytes are the test's alone and every gauge is checked exactly: size,
provisioned and available against what the test made, allocated against the blocks of the pool's
backing files, the filesystem's against statvfs, all read while the pool holds still. Through
creates, a write into a backing file and into a mounted volume, a snapshot, an inline volume, an
overcommit and the deletes; a shared pool's controller alone exports it (node plugins none, so a
sum counts nothing twice); node-local pools are labelled with their node and kinds."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubeloop_grpc.csi import csi_pb2
from tests.support.waits import WaitFailed, eventually

from .conftest import Client, Driver, stop_and_clean
from .inline import publish_with, unpublish
from .processes import free_port, readyz, running, wait_serving
from .volumes import Attached, create, mount_cap, write_data

pytestmark = pytest.mark.root

MiB = 1 << 20
GiB = 1 << 30
POOL_SIZE = 512 * MiB  # each pool's tmpfs
Gauges = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@contextlib.contextmanager
def tmpfs_pool(path: Path, size: int = POOL_SIZE) -> Iterator[Path]:
    """A filesystem of the pool's own, unmounted afterwards (the drivers on it stopped first)."""
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "kubeloop-pool", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def scrape(port: int) -> Gauges:
    """The kubeloop_pool_* samples a process serves."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as rsp:
        text = rsp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("kubeloop_pool_")
    }


def on_disk(pool: Path) -> tuple[int, int, int]:
    """The blocks every backing file of the pool takes (volumes, snapshots, inline volumes), and
    its filesystem's size and free bytes."""
    used = 0
    for sub in ("volumes", "snapshots", "ephemeral"):
        with contextlib.suppress(FileNotFoundError), os.scandir(pool / sub) as entries:
            for entry in entries:
                if entry.name.endswith(".img"):
                    used += entry.stat(follow_symlinks=False).st_blocks * 512
    fs = os.statvfs(pool)
    return used, fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize


class Pool:
    """What the test expects a pool's gauges to say: sizes it configured and provisioned, and
    what its disk holds."""

    def __init__(self, path: Path, node: str, sizes: dict[str, int]) -> None:
        self.path, self.node, self.sizes = path, node, sizes
        self.provisioned = dict.fromkeys(sizes, 0)

    def expected(self) -> Gauges:
        used, fs_size, fs_free = on_disk(self.path)
        assert len(self.sizes) == 1 or not used, "allocated per kind: count it in the test that needs it"
        gauges: Gauges = {}
        for kind, size in self.sizes.items():
            labels = (("kind", kind), ("node", self.node))
            gauges[("kubeloop_pool_size_bytes", labels)] = size
            gauges[("kubeloop_pool_provisioned_bytes", labels)] = self.provisioned[kind]
            gauges[("kubeloop_pool_allocated_bytes", labels)] = used
            gauges[("kubeloop_pool_available_bytes", labels)] = max(0, size - self.provisioned[kind])
        gauges[("kubeloop_pool_filesystem_size_bytes", (("node", self.node),))] = fs_size
        gauges[("kubeloop_pool_filesystem_free_bytes", (("node", self.node),))] = fs_free
        return gauges


def settled(port: int, expected: Callable[[], Gauges], timeout: float = 20.0) -> Gauges:
    """The gauges once they say what the pool holds: a scrape between two readings of the pool
    that agree (a measurement is served again for up to a second, and a freshly mounted ext4
    still writes in the background)."""
    seen: dict[str, Gauges] = {}

    def agree() -> bool:
        before, seen["scraped"], seen["pool"] = expected(), scrape(port), expected()
        return seen["scraped"] == before == seen["pool"]

    try:
        eventually("the gauges to say what the pool holds", agree, timeout, interval=0.2)
    except WaitFailed:
        assert seen["scraped"] == seen["pool"]
        raise
    return seen["scraped"]


def capacity(client: Client, **parameters: str) -> int:
    req = csi_pb2.GetCapacityRequest(volume_capabilities=[mount_cap()], parameters=parameters)
    return int(client.controller.GetCapacity(req).available_capacity)


def gauge(gauges: Gauges, name: str, node: str = "", kind: str | None = "") -> float:
    labels = (("node", node),) if kind is None else (("kind", kind), ("node", node))
    return gauges[(f"kubeloop_pool_{name}_bytes", labels)]


def test_the_gauges_follow_creates_writes_snapshots_inline_volumes_and_deletes(csi_root: Path) -> None:
    """A `--mode all` driver of a shared pool (`node` ""), `--capacity 1Gi` on a 512Mi disk."""
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="pm", dir=csi_root))
    with tmpfs_pool(work / "pool") as path:
        d = Driver(work, "all", "node-a", ["--capacity", "1Gi", "--http-endpoint", f"127.0.0.1:{port}"])
        pool = Pool(path, "", {"": GiB})
        try:
            d.start()
            client = Client(d.endpoint)
            assert (
                settled(port, pool.expected)[("kubeloop_pool_allocated_bytes", (("kind", ""), ("node", "")))]
                == 0
            )
            a = create(client, "a", size=64 * MiB)
            b = create(client, "b", size=128 * MiB)
            pool.provisioned[""] = 192 * MiB
            gauges = settled(port, pool.expected)
            assert gauge(gauges, "allocated") == 0  # sparse: nothing written yet
            assert gauge(gauges, "available") == capacity(client) == GiB - 192 * MiB
            # Written into the backing file: allocated grows by exactly that (tmpfs pages).
            fd = os.open(path / "volumes" / f"{b.volume_id}.img", os.O_WRONLY)
            try:
                os.pwrite(fd, b"\x5a" * 8 * MiB, 16 * MiB)
                os.fsync(fd)
            finally:
                os.close(fd)
            assert gauge(settled(port, pool.expected), "allocated") == 8 * MiB
            # Written into a mounted volume: its filesystem and the data reach the backing file.
            attached = Attached(client, d, a.volume_id, mount_cap())
            formatted = gauge(settled(port, pool.expected), "allocated")
            write_data(attached.target, 16 * MiB)
            gauges = settled(port, pool.expected)
            assert gauge(gauges, "allocated") >= formatted + 16 * MiB > 24 * MiB
            # A snapshot takes its size from the budget, and on disk what its source holds.
            snap = client.controller.CreateSnapshot(
                csi_pb2.CreateSnapshotRequest(name="snap", source_volume_id=b.volume_id)
            ).snapshot
            pool.provisioned[""] += 128 * MiB
            settled(port, pool.expected)
            assert (path / "snapshots" / f"{snap.snapshot_id}.img").stat().st_blocks * 512 == 8 * MiB
            # An inline volume: its reservation, and the blocks its filesystem takes.
            publish_with(client, d, "scratch", {"size": "32Mi"})
            pool.provisioned[""] += 32 * MiB
            settled(port, pool.expected)
            # Overcommitted: the volumes could be written to more than the disk can give (what
            # KubeloopPoolOvercommitted fires on), though --capacity still has room.
            c = create(client, "c", size=256 * MiB)
            pool.provisioned[""] += 256 * MiB
            gauges = settled(port, pool.expected)
            shortfall = gauge(gauges, "provisioned") - gauge(gauges, "allocated")
            assert shortfall > gauge(gauges, "filesystem_free", kind=None)
            assert gauge(gauges, "available") == capacity(client) == GiB - 608 * MiB
            # Everything gone: nothing held, nothing on disk.
            unpublish(client, d, "scratch")
            attached.close()
            client.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))
            for vol in (a, b, c):
                client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
            pool.provisioned[""] = 0
            gauges = settled(port, pool.expected)
            assert gauge(gauges, "allocated") == 0 and gauge(gauges, "available") == GiB
            client.close()
        finally:
            stop_and_clean(d, work)


def test_a_shared_pool_is_exported_once_by_its_controller(csi_root: Path) -> None:
    """A controller-mode driver and two node plugins on one pool: the controller's gauges count
    node-b's inline volume beside its own volume, the node plugins serve none, so a sum over every
    process's series is the pool's once. A thin pool (no --capacity) is its filesystem."""
    base = Path(tempfile.mkdtemp(prefix="ps", dir=csi_root))
    ports = {name: free_port() for name in ("c", "a", "b")}
    with tmpfs_pool(base / "pool") as path:
        drivers = [
            Driver(base / "c", "controller", extra=["--http-endpoint", f"127.0.0.1:{ports['c']}"], pool=path),
            *(
                Driver(base / n, "node", f"node-{n}", ["--http-endpoint", f"127.0.0.1:{ports[n]}"], pool=path)
                for n in ("a", "b")
            ),
        ]
        for d in drivers:
            d.root.mkdir()
            d.launch()
        node_b = drivers[2]
        with running(*drivers) as (client, _, client_b):
            vol = create(client, "data", size=64 * MiB)
            publish_with(client_b, node_b, "scratch", {"size": "32Mi"})
            _, fs_size, _ = on_disk(path)
            pool = Pool(path, "", {"": fs_size})
            pool.provisioned[""] = 96 * MiB

            def thin() -> Gauges:  # without --capacity, what is left is the filesystem's
                gauges = pool.expected()
                gauges[("kubeloop_pool_available_bytes", (("kind", ""), ("node", "")))] = on_disk(path)[2]
                return gauges

            gauges = settled(ports["c"], thin)
            assert gauge(gauges, "allocated") > 0  # the inline volume's filesystem, made by node-b
            assert scrape(ports["a"]) == scrape(ports["b"]) == {}
            unpublish(client_b, node_b, "scratch")
            client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
            pool.provisioned[""] = 0
            assert gauge(settled(ports["c"], thin), "allocated") == 0


def test_node_local_pools_are_labelled_with_their_node_and_kinds(csi_root: Path) -> None:
    """Two node-local drivers, each on its own disk: node-1's pool split into kinds, node-2's one
    --capacity; each exports its own pool under its node's name."""
    ports = [free_port(), free_port()]
    flags = [["--capacity", "fast=256Mi", "--capacity", "slow=1Gi"], ["--capacity", "384Mi"]]
    with contextlib.ExitStack() as stack:
        drivers, pools = [], []
        for i, (port, extra) in enumerate(zip(ports, flags, strict=True), 1):
            work = Path(tempfile.mkdtemp(prefix="nl", dir=csi_root))
            path = stack.enter_context(tmpfs_pool(work / "pool"))
            d = Driver(
                work, "all", f"node-{i}", ["--node-local", "--http-endpoint", f"127.0.0.1:{port}", *extra]
            )
            drivers.append(d.launch())
            pools.append(
                Pool(path, f"node-{i}", {"fast": 256 * MiB, "slow": GiB} if i == 1 else {"": 384 * MiB})
            )
        with running(*drivers) as (one, two):
            fast = create(one, "quick", size=100 * MiB, parameters={"kind": "fast"})
            pools[0].provisioned["fast"] = 100 * MiB
            plain = create(two, "plain", size=300 * MiB)
            pools[1].provisioned[""] = 300 * MiB
            for port, pool in zip(ports, pools, strict=True):
                settled(port, pool.expected)
            assert capacity(one, kind="fast") == 156 * MiB and capacity(two) == 84 * MiB
            one.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=fast.volume_id))
            two.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=plain.volume_id))
            pools[0].provisioned["fast"] = pools[1].provisioned[""] = 0
            for port, pool in zip(ports, pools, strict=True):
                settled(port, pool.expected)


def test_a_pool_less_start_exports_no_pool(csi_root: Path) -> None:
    """A node-local plugin whose pool's disk is not there never takes the pool: no series (its
    Probe and /readyz say why), rather than gauges of the directory below the mount point."""
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="nl", dir=csi_root))
    d = Driver(
        work, "all", "node-1", ["--node-local", "--capacity", "1Gi", "--http-endpoint", f"127.0.0.1:{port}"]
    )
    d.launch()
    try:
        wait_serving(d)
        assert readyz(port)[0] == 503
        assert scrape(port) == {}
    finally:
        stop_and_clean(d, work)
