"""Inline ephemeral volumes in the pool's `--capacity` budget (issue 44, part 3), on real loop
devices and mounts: they take from the budget persistent volumes take from, a shared pool's node
plugins and its controller (separate processes) never promise the same bytes twice, GetCapacity
says exactly what is left, a refusal says why, and a kill -9 at any point of an inline publish
leaves no room held for a volume that does not exist."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from csi_driver.budget import PoolBudget, Reservation
from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc
from tests.support.waits import eventually

from .conftest import Client, Driver, stop_and_clean
from .inline import handle, nothing_left, publish_killed, publish_with, unpublish
from .volumes import create

pytestmark = pytest.mark.root

MiB = 1 << 20
GiB = 1 << 30
BUDGET = ["--capacity", "1Gi"]


def made(pool: Path) -> int:
    """What exists in the pool: the size of every backing file, snapshot copy and inline volume
    (temporary files of a copy or a create included)."""
    total = 0
    for sub in ("volumes", "snapshots", "ephemeral"):
        with contextlib.suppress(FileNotFoundError), os.scandir(pool / sub) as entries:
            for entry in entries:
                if not entry.name.endswith(".json"):
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat(follow_symlinks=False).st_size
    return total


def left(client: Client, **parameters: str) -> int:
    return int(
        client.controller.GetCapacity(csi_pb2.GetCapacityRequest(parameters=parameters)).available_capacity
    )


def refusal(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


@pytest.fixture
def budgeted(csi_root: Path) -> Iterator[Driver]:
    """A `--mode all` driver whose pool offers 1Gi."""
    work = Path(tempfile.mkdtemp(prefix="b", dir=csi_root))
    d = Driver(work, "all", "node-a", BUDGET).start()
    try:
        yield d
    finally:
        stop_and_clean(d, work)


def test_inline_and_persistent_volumes_take_from_one_budget(budgeted: Driver) -> None:
    client = Client(budgeted.endpoint)
    try:
        assert left(client) == GiB
        publish_with(client, budgeted, "scratch", {"size": "256Mi"})
        assert left(client) == 768 * MiB  # before the fix: 1Gi, the inline volume uncounted
        vol = create(client, "data", size=512 * MiB)
        assert left(client) == 256 * MiB == GiB - made(budgeted.pool)
        # An inline volume that does not fit: refused before anything is made, saying why.
        err = refusal(lambda: publish_with(client, budgeted, "greedy", {"size": "300Mi"}))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.details() == (
            "node node-a cannot make an inline volume of 300Mi: the pool's --capacity 1Gi has 256Mi "
            "left (512Mi held by persistent volumes and snapshots, 256Mi by inline volumes)"
        )
        assert not (budgeted.pool / "ephemeral" / f"{handle('greedy')}.img").exists()
        assert not (budgeted.state / "staging" / f"{handle('greedy')}.json").exists()
        # A persistent volume that does not fit says what inline volumes hold.
        err = refusal(lambda: create(client, "big", size=300 * MiB))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "inline ephemeral volumes hold 256Mi" in str(err.details())
        # What fits exactly fits.
        publish_with(client, budgeted, "last", {"size": "256Mi"})
        assert left(client) == 0
        for name in ("scratch", "last"):
            unpublish(client, budgeted, name)
        assert left(client) == 512 * MiB
        client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
        assert left(client) == GiB
        nothing_left(budgeted)
    finally:
        client.close()


def test_inline_volumes_choose_a_pool_kind(csi_root: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="k", dir=csi_root))
    d = Driver(work, "all", "node-a", ["--capacity", "fast=512Mi", "--capacity", "slow=1Gi"]).start()
    client = Client(d.endpoint)
    try:
        publish_with(client, d, "quick", {"size": "400Mi", "kind": "fast"})
        assert (left(client, kind="fast"), left(client, kind="slow")) == (112 * MiB, GiB)
        err = refusal(lambda: publish_with(client, d, "more", {"size": "200Mi", "kind": "fast"}))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--capacity fast=512Mi has 112Mi left" in str(err.details())
        publish_with(client, d, "more", {"size": "200Mi", "kind": "slow"})
        assert left(client, kind="slow") == 824 * MiB
        for attributes, words in (
            ({"size": "10Mi"}, "is split into kinds (fast, slow); choose one with the inline volume's"),
            ({"size": "10Mi", "kind": "gold"}, "'gold' is not a pool kind of node node-a"),
        ):
            err = refusal(lambda a=attributes: publish_with(client, d, "nokind", a))  # type: ignore[misc]
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in str(err.details())
        for name in ("quick", "more"):
            unpublish(client, d, name)
        assert (left(client, kind="fast"), left(client, kind="slow")) == (512 * MiB, GiB)
        nothing_left(d)
    finally:
        client.close()
        stop_and_clean(d, work)


class Sampler:
    """Measures what the pool holds every few milliseconds while the creates run."""

    def __init__(self, pool: Path) -> None:
        self.pool = pool
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, made(self.pool))
            self.samples += 1
            self._stop.wait(0.002)  # the next sample, or at once when stopped

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def test_concurrent_inline_and_persistent_creates_on_a_shared_pool_never_overcommit(csi_root: Path) -> None:
    """The local stack's layout: a controller with --capacity 1Gi and two node plugins on one
    pool, three processes with state directories of their own. Rounds of persistent creates and
    inline publishes at once ask for far more than 1Gi: never more than 1Gi is made, the rest is
    refused with RESOURCE_EXHAUSTED, and GetCapacity is exact after every round and, one call at
    a time, after every create and delete."""
    base = Path(tempfile.mkdtemp(prefix="sb", dir=csi_root))
    pool = base / "pool"
    controller = Driver(base / "c", "controller", pool=pool, extra=BUDGET)
    nodes = [Driver(base / f"n{i}", "node", node_id=f"node-{i}", pool=pool) for i in range(2)]
    for d in (controller, *nodes):
        d.root.mkdir()
    controller.start()  # publishes the budget before the node plugins count on it
    for d in nodes:
        d.start()
    ctl = Client(controller.endpoint)
    clients = [Client(d.endpoint) for d in nodes]
    rng = random.Random(44)
    volumes: dict[str, int] = {}  # volume id -> size
    inline: dict[str, tuple[int, int]] = {}  # name -> (node index, size)
    refused: list[str] = []
    lock = threading.Lock()

    def create_persistent(name: str, size: int) -> None:
        try:
            vol = create(ctl, name, size=size)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            with lock:
                refused.append(f"persistent {size >> 20}Mi: {e.details()}")
            return
        with lock:
            volumes[vol.volume_id] = size

    def publish_inline(i: int, name: str, size: int) -> None:
        try:
            publish_with(clients[i], nodes[i], name, {"size": f"{size >> 20}Mi"}, timeout=60)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert f"cannot make an inline volume of {size >> 20}Mi" in str(e.details())
            with lock:
                refused.append(f"inline {size >> 20}Mi: {e.details()}")
            return
        with lock:
            inline[name] = (i, size)

    def delete_persistent(volume_id: str) -> None:
        ctl.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=volume_id))
        del volumes[volume_id]

    def unpublish_inline(name: str) -> None:
        unpublish(clients[inline[name][0]], nodes[inline[name][0]], name)
        del inline[name]

    def exact() -> None:
        now = made(pool)
        assert now == sum(volumes.values()) + sum(s for _, s in inline.values())
        assert now <= GiB and left(ctl) == GiB - now

    try:
        with Sampler(pool) as sampler, ThreadPoolExecutor(max_workers=12) as workers:
            for round_ in range(3):
                jobs = [
                    workers.submit(create_persistent, f"r{round_}-p{j}", rng.choice((96, 160, 224)) * MiB)
                    for j in range(5)
                ] + [
                    workers.submit(publish_inline, i, f"r{round_}-n{i}-{j}", rng.choice((64, 128, 192)) * MiB)
                    for i in range(2)
                    for j in range(3)
                ]
                for job in jobs:
                    job.result()
                exact()
                # Half of what exists goes again, at once, and the budget follows.
                gone = [workers.submit(delete_persistent, v) for v in list(volumes)[::2]]
                gone += [workers.submit(unpublish_inline, n) for n in list(inline)[::2]]
                for job in gone:
                    job.result()
                exact()
        print(
            f"peak {sampler.peak >> 20}Mi over {sampler.samples} samples; {len(refused)} refused, "
            f"{len(volumes)} volumes and {len(inline)} inline volumes left"
        )
        assert sampler.peak <= GiB, f"{sampler.peak >> 20}Mi made against a 1Gi --capacity"
        assert any(r.startswith("inline") for r in refused) and any(
            r.startswith("persistent") for r in refused
        )
        # One call at a time: GetCapacity exact after each create and each delete.
        for step in range(8):
            if step % 2 == 0:
                create_persistent(f"s{step}", 64 * MiB)
                publish_inline(step % 4 // 2, f"s{step}", 64 * MiB)
            exact()
            if volumes and step % 3 == 2:
                delete_persistent(next(iter(volumes)))
                exact()
            if inline and step % 3 == 1:
                unpublish_inline(next(iter(inline)))
                exact()
        for v in list(volumes):
            delete_persistent(v)
        for n in list(inline):
            unpublish_inline(n)
        assert left(ctl) == GiB and made(pool) == 0
        assert [p.name for p in (pool / "ephemeral").iterdir()] == []
    finally:
        for c in (ctl, *clients):
            c.close()
        for d in nodes:
            stop_and_clean(d, d.root)
        stop_and_clean(controller, base)


@contextlib.contextmanager
def budget_held(pool: Path) -> Iterator[None]:
    """Holds the pool's budget lock as another process deciding would."""
    fd = os.open(pool / ".budget.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@pytest.mark.parametrize("reserved", [False, True], ids=["before-reservation", "before-file"])
def test_kill9_between_intent_reservation_and_file_holds_no_room_after_the_restart(
    budgeted: Driver, reserved: bool
) -> None:
    """A publish killed after its intent record, before its reservation (it waits for the budget
    another process holds), or after the reservation, before its backing file (that state made
    with the driver's own reservation writer): the restarted plugin holds no room for a volume
    that does not exist, kubelet's next publish makes it, its unpublish removes it all."""
    name = "killed"
    errors: list[BaseException] = []

    def run() -> None:
        try:
            client = Client(budgeted.endpoint)
            try:
                publish_with(client, budgeted, name, {"size": "256Mi"}, timeout=20)
            finally:
                client.close()
        except grpc.RpcError as e:
            errors.append(e)

    record = budgeted.state / "staging" / f"{handle(name)}.json"
    with budget_held(budgeted.pool):
        worker = threading.Thread(target=run)
        worker.start()
        eventually("the publish's intent record", record.exists, timeout=20, interval=0.01)
        time.sleep(0.2)  # it now waits for the budget
        budgeted.kill9()
    worker.join()
    assert errors, "the publish answered although it could not take the budget"
    if reserved:
        PoolBudget(budgeted.pool, lambda _: 0).reserve(Reservation(handle(name), 256 * MiB, "", "node-a"))
    assert not (budgeted.pool / "ephemeral" / f"{handle(name)}.img").exists()
    budgeted.start()
    client = Client(budgeted.endpoint)
    try:
        assert left(client) == GiB  # no room held for what was never made
        assert not record.exists() and not (budgeted.pool / "ephemeral" / f"{handle(name)}.json").exists()
        unpublish(client, budgeted, name)  # the pod went meanwhile: nothing to undo
        publish_with(client, budgeted, name, {"size": "256Mi"})  # or it is still there
        assert left(client) == 768 * MiB
        unpublish(client, budgeted, name)
        assert left(client) == GiB
        nothing_left(budgeted)
    finally:
        client.close()


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1, 0.2])
def test_kill9_anywhere_in_an_inline_publish_leaves_the_budget_exact(budgeted: Driver, delay: float) -> None:
    """Wherever the kill lands, the restarted driver counts exactly what exists (a backing file
    made is the pod's until kubelet's unpublish), and after the unpublish the budget is whole."""
    publish_killed(budgeted, "crashy", {"size": "192Mi"}, delay)
    client = Client(budgeted.endpoint)
    try:
        assert left(client) == GiB - made(budgeted.pool)
        unpublish(client, budgeted, "crashy")
        assert left(client) == GiB
        nothing_left(budgeted)
    finally:
        client.close()


def test_an_inline_volume_made_before_volumes_were_counted_is_counted_at_start(budgeted: Driver) -> None:
    client = Client(budgeted.endpoint)
    publish_with(client, budgeted, "old", {"size": "128Mi"})
    client.close()
    budgeted.kill9()
    (budgeted.pool / "ephemeral" / f"{handle('old')}.json").unlink()  # as an older driver made it
    budgeted.start()
    client = Client(budgeted.endpoint)
    try:
        assert left(client) == 896 * MiB
        unpublish(client, budgeted, "old")
        assert left(client) == GiB
        nothing_left(budgeted)
    finally:
        client.close()


def test_a_group_snapshot_whose_last_member_does_not_fit_gives_all_its_room_back(budgeted: Driver) -> None:
    """The members are recorded one by one, each taking its room: when one does not fit, those
    recorded before it go at once (as a failed CreateSnapshot's), not at the driver's next start,
    so neither persistent nor inline volumes are refused for room nothing holds."""
    client = Client(budgeted.endpoint)
    small, large = create(client, "small", 300 * MiB), create(client, "large", 400 * MiB)
    before = left(client)
    assert before == GiB - 700 * MiB
    group = csi_pb2_grpc.GroupControllerStub(client.channel)
    err = refusal(
        lambda: group.CreateVolumeGroupSnapshot(
            csi_pb2.CreateVolumeGroupSnapshotRequest(
                name="both", source_volume_ids=[small.volume_id, large.volume_id]
            ),
            timeout=60,
        )
    )
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert left(client) == before
    assert made(budgeted.pool) == 700 * MiB
    assert not any(p.suffix == ".json" for p in (budgeted.pool / "snapshots").iterdir())
    client.close()
