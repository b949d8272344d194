"""csi_driver.pool_metrics without root: what the gauges say of a pool of sparse files (thin, one
--capacity, kinds), that a scrape measures off the event loop at most once per MAX_AGE and never
twice at once, and the HTTP endpoint's refresh hook. The driver's own /metrics, on real loop
devices and mounts, is tests/csi/test_pool_metrics.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from controller_runtime.health import HealthServer
from controller_runtime.metrics import Counter, Registry
from csi_driver.budget import Reservation
from csi_driver.pool_kinds import PoolCapacity
from csi_driver.pool_metrics import Holder, KindUsage, PoolMetrics, PoolUsage, measure
from csi_driver.state import DriverState, SnapshotRecord, VolumeRecord

MiB = 1 << 20
GiB = 1 << 30


def sparse(path: Path, size: int, written: int = 0) -> str:
    """A sparse file of `size` with its first `written` bytes written and on disk."""
    with open(path, "wb") as f:
        f.truncate(size)
        f.write(b"\xa5" * written)
        f.flush()
        os.fsync(f.fileno())
    return str(path)


def filesystem(path: Path) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def blocks(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_a_thin_pool_is_its_filesystem(tmp_path: Path) -> None:
    a = sparse(tmp_path / "a.img", 64 * MiB, MiB)
    b = sparse(tmp_path / "b.img", 32 * MiB)
    usage = measure(str(tmp_path), PoolCapacity(), [Holder(a, "", 64 * MiB), Holder(b, "fast", 32 * MiB)])
    size, free = filesystem(tmp_path)
    assert usage.filesystem_size == size and abs(usage.filesystem_free - free) < 64 * MiB
    # Every holder under kind "", whatever kind its record names: the budget counts it so.
    assert usage.kinds == {
        "": KindUsage(size, 96 * MiB, blocks(a) + blocks(b), usage.filesystem_free),
    }
    assert blocks(a) >= MiB and blocks(b) == 0


def test_one_capacity_and_kinds(tmp_path: Path) -> None:
    a = sparse(tmp_path / "a.img", 64 * MiB, 2 * MiB)
    b = sparse(tmp_path / "b.img", 32 * MiB, MiB)
    holders = [
        Holder(a, "fast", 64 * MiB),
        Holder(b, "slow", 32 * MiB),
        Holder(str(tmp_path / "not-made-yet.img"), "slow", 16 * MiB),  # a reservation before its file
        Holder(str(tmp_path / "gone.img"), "old", 8 * MiB),  # a kind the flags no longer configure
    ]
    one = measure(str(tmp_path), PoolCapacity(total=100 * MiB), holders)
    used = blocks(a) + blocks(b)
    assert one.kinds == {"": KindUsage(100 * MiB, 120 * MiB, used, 0)}  # over its budget: none left
    kinds = measure(
        str(tmp_path), PoolCapacity(kinds={"fast": 100 * MiB, "slow": 40 * MiB, "idle": MiB}), holders
    )
    assert kinds.kinds == {
        "fast": KindUsage(100 * MiB, 64 * MiB, blocks(a), 36 * MiB),
        "idle": KindUsage(MiB, 0, 0, MiB),
        "old": KindUsage(0, 8 * MiB, 0, 0),
        "slow": KindUsage(40 * MiB, 48 * MiB, blocks(b), 0),
    }


def test_a_symlink_in_the_pool_takes_nothing(tmp_path: Path) -> None:
    real = sparse(tmp_path / "elsewhere.img", 8 * MiB, MiB)
    (tmp_path / "a.img").symlink_to(real)
    usage = measure(str(tmp_path), PoolCapacity(total=GiB), [Holder(str(tmp_path / "a.img"), "", 8 * MiB)])
    assert usage.kinds[""].allocated == 0


async def loaded(tmp_path: Path) -> DriverState:
    state = DriverState(tmp_path / "pool", tmp_path / "state")
    await state.load()
    return state


def samples(registry: Registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = registry.exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_the_collector_counts_records_and_every_reservation(tmp_path: Path) -> None:
    state = await loaded(tmp_path)
    try:
        await state.put_volume(VolumeRecord("vol-a", "a", 64 * MiB, 1, "mount", "ext4", kind="fast"))
        sparse(Path(state.volume_file("vol-a")), 64 * MiB, 3 * MiB)
        await state.put_snapshot(SnapshotRecord("snap-a", "s", "vol-a", 64 * MiB, 2, ready=True, kind="fast"))
        sparse(Path(state.snapshot_file("snap-a")), 64 * MiB, 3 * MiB)
        # Another node's inline volume, in the same pool.
        state.budget.reserve(Reservation("csi-e", 16 * MiB, "slow", "node-b"))
        sparse(Path(state.ephemeral_file("csi-e")), 16 * MiB, MiB)
        metrics = PoolMetrics(state, PoolCapacity(kinds={"fast": 256 * MiB, "slow": 32 * MiB}), "node-a")
        registry = Registry([])
        registry.register(metrics)
        assert samples(registry) == {}  # nothing before the first measurement
        await metrics.refresh()
        fs_size, _ = filesystem(state.pool_dir)
        got = samples(registry)
        fs_free = got[("kubeloop_pool_filesystem_free_bytes", (("node", "node-a"),))]
        fast = blocks(state.volume_file("vol-a")) + blocks(state.snapshot_file("snap-a"))
        slow = blocks(state.ephemeral_file("csi-e"))
        assert got == {
            ("kubeloop_pool_size_bytes", (("kind", "fast"), ("node", "node-a"))): 256 * MiB,
            ("kubeloop_pool_size_bytes", (("kind", "slow"), ("node", "node-a"))): 32 * MiB,
            ("kubeloop_pool_provisioned_bytes", (("kind", "fast"), ("node", "node-a"))): 128 * MiB,
            ("kubeloop_pool_provisioned_bytes", (("kind", "slow"), ("node", "node-a"))): 16 * MiB,
            ("kubeloop_pool_allocated_bytes", (("kind", "fast"), ("node", "node-a"))): fast,
            ("kubeloop_pool_allocated_bytes", (("kind", "slow"), ("node", "node-a"))): slow,
            ("kubeloop_pool_available_bytes", (("kind", "fast"), ("node", "node-a"))): 128 * MiB,
            ("kubeloop_pool_available_bytes", (("kind", "slow"), ("node", "node-a"))): 16 * MiB,
            ("kubeloop_pool_filesystem_size_bytes", (("node", "node-a"),)): fs_size,
            ("kubeloop_pool_filesystem_free_bytes", (("node", "node-a"),)): fs_free,
        }
        assert fast >= 6 * MiB and slow >= MiB
    finally:
        state.close()


async def test_a_scrape_measures_at_most_once_per_max_age_and_never_twice_at_once(tmp_path: Path) -> None:
    state = await loaded(tmp_path)
    now = [100.0]
    metrics = PoolMetrics(state, PoolCapacity(total=GiB), "", max_age=1.0, clock=lambda: now[0])
    runs = []
    real = metrics._measure

    def counted(records: list[Holder]) -> PoolUsage:
        runs.append(now[0])
        return real(records)

    metrics._measure = counted  # type: ignore[method-assign]
    try:
        await asyncio.gather(*(metrics.refresh() for _ in range(5)))
        assert runs == [100.0]
        await state.put_volume(VolumeRecord("vol-a", "a", 64 * MiB, 1, "mount", "ext4"))
        now[0] = 100.9
        await metrics.refresh()
        assert runs == [100.0] and metrics.usage is not None
        assert metrics.usage.kinds[""].provisioned == 0  # the last measurement, under a second old
        now[0] = 101.0
        await metrics.refresh()
        assert runs == [100.0, 101.0]
        assert metrics.usage.kinds[""].provisioned == 64 * MiB
    finally:
        state.close()


async def test_a_pool_that_cannot_be_measured_has_no_series(tmp_path: Path) -> None:
    state = await loaded(tmp_path)
    try:
        metrics = PoolMetrics(state, PoolCapacity(total=GiB), "node-a", max_age=0)
        registry = Registry([])
        registry.register(metrics)
        await metrics.refresh()
        assert samples(registry)
        state.pool_dir.rename(tmp_path / "moved")
        await metrics.refresh()
        assert samples(registry) == {}
    finally:
        state.close()


async def test_the_endpoint_awaits_its_refreshes_before_it_collects() -> None:
    registry = Registry([])
    scraped = Counter("kubeloop_test_refreshes", "refreshes before the scrape", registry=registry)
    server = HealthServer("127.0.0.1:0", registry=registry)

    async def refresh() -> None:
        await asyncio.sleep(0)
        scraped.inc()

    async def broken() -> None:
        raise RuntimeError("boom")

    server.add_metrics_refresh(broken)  # logged; the rest is still refreshed and served
    server.add_metrics_refresh(refresh)
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            for n in (1, 2):
                async with http.get(f"http://127.0.0.1:{server.port}/metrics") as resp:
                    assert resp.status == 200
                    assert f"kubeloop_test_refreshes_total {n}.0" in await resp.text()
    finally:
        await server.stop()
