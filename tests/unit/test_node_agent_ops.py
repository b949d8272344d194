"""The node agent's operation runner: different volumes in parallel up to the limit, started in the
order queued, never two operations on one volume, and a queued mount dropped when its pod left."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from controller_runtime.client import ApiClient
from controller_runtime.events import EventRecorder
from controller_runtime.volumes import CSIVolume
from services.node_agent.actual_state import DeviceMountState
from services.node_agent.agent import NodeAgent, Options
from services.node_agent.decide import PodVolume
from services.node_agent.plugins import Plugin

DRIVER = "loop.csi.kubeloop.dev"


def agent(tmp_path: Path, limit: int) -> NodeAgent:
    client = cast(ApiClient, object())
    recorder = cast(EventRecorder, object())
    return NodeAgent(client, recorder, "node-a", tmp_path, Options(max_concurrent_operations=limit))


async def _drain(a: NodeAgent) -> None:
    await a.volumes.operations.wait()


def test_operations_run_in_parallel_up_to_the_limit_in_queue_order(tmp_path: Path) -> None:
    async def main() -> None:
        a = agent(tmp_path, 2)
        running: set[int] = set()
        peak = 0
        started: list[int] = []

        async def op(i: int) -> None:
            nonlocal peak
            started.append(i)
            running.add(i)
            peak = max(peak, len(running))
            await asyncio.sleep(0)  # the other operations run meanwhile
            running.discard(i)

        for i in range(6):
            a.volumes.operations.run((DRIVER, f"v{i}"), op(i), operation=("mount", i))
        assert a.volumes.operations.is_pending((DRIVER, "v0"), ("mount", 0)), (
            "a queued operation holds its volume"
        )
        await _drain(a)
        assert peak == 2
        assert started == list(range(6))

    asyncio.run(main())


def test_no_limit_runs_everything_at_once(tmp_path: Path) -> None:
    async def main() -> None:
        a = agent(tmp_path, 0)
        running: set[int] = set()
        peak = 0

        async def op(i: int) -> None:
            nonlocal peak
            running.add(i)
            peak = max(peak, len(running))
            await asyncio.sleep(0)  # the other operations run meanwhile
            running.discard(i)

        for i in range(5):
            a.volumes.operations.run((DRIVER, f"v{i}"), op(i), operation=("mount", i))
        await _drain(a)
        assert peak == 5

    asyncio.run(main())


def test_queued_mount_of_a_pod_that_left_does_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        a = agent(tmp_path, 1)
        vol = CSIVolume("pv-v1", DRIVER, "v1", ("ReadWriteOnce",), False, "ext4", False, (), {})
        pv = PodVolume("uid-1", "ns/p1", vol, False)
        # No pod in the cache and no driver registered: had the mount begun, it would raise NotReady.
        generator = a.volumes.generator
        await generator.mount(pv)
        assert not a.volumes.actual.get_all_mounted_volumes()
        assert not a.volumes.actual.get_possibly_mounted_devices()
        pod: dict[str, Any] = {"metadata": {"namespace": "ns", "name": "p1", "uid": "uid-1"}}
        a.volumes.pods.store.upsert(pod)
        assert generator.still_wanted(pv)
        a.volumes.pods.store.upsert(
            {"metadata": {**pod["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
        )
        assert not generator.still_wanted(pv), "a pod being deleted gets nothing new mounted"
        a.volumes.pods.store.upsert({"metadata": {**pod["metadata"], "uid": "uid-2"}})
        assert not generator.still_wanted(pv), "a new pod of the same name is a different pod"

    asyncio.run(main())


class _SlowPatchClient:
    """Stands in for the API client: a status patch during which an operation finishes."""

    def __init__(self, during: Any) -> None:
        self.during = during
        self.patches: list[Any] = []

    async def patch(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.patches.append(args)
        self.during()
        await asyncio.sleep(0)
        return {}


def test_pass_decides_on_the_state_after_its_volumes_in_use_write(tmp_path: Path) -> None:
    """An unstage that finished while volumesInUse was being written is not started again."""

    async def main() -> None:
        key = (DRIVER, "v1")
        a = agent(tmp_path, 2)
        a.volumes.actual.mark_device_as_mounted(key)

        def unstage_finishes() -> None:
            a.volumes.actual.mark_device_as_unmounted(key)

        fake = _SlowPatchClient(unstage_finishes)
        a.volumes.reconciler.client = cast(ApiClient, fake)
        await a.reconcile()
        assert fake.patches, "volumesInUse was written"
        assert not a.volumes.operations.in_flight(key), (
            "no second unstage from the plan made before the write"
        )

    asyncio.run(main())


def test_unstage_goes_ahead_of_queued_unpublishes_and_cancelled_waiters_give_up_their_place() -> None:
    from controller_runtime.operations import OperationSlots
    from services.node_agent.reconciler import UNPUBLISH, UNSTAGE

    async def main() -> None:
        slots = OperationSlots(1)
        order: list[str] = []
        gate = asyncio.Event()

        async def op(name: str, priority: int) -> None:
            async with slots.hold(priority):
                order.append(name)
                await gate.wait()

        first = asyncio.create_task(op("unpublish-1", UNPUBLISH))
        await asyncio.sleep(0)
        queued = [asyncio.create_task(op(n, UNPUBLISH)) for n in ("unpublish-2", "unpublish-3")]
        gone = asyncio.create_task(op("cancelled", UNSTAGE))
        unstage = asyncio.create_task(op("unstage-1", UNSTAGE))
        await asyncio.sleep(0)
        gone.cancel()
        gate.set()
        await asyncio.gather(first, *queued, unstage)
        assert order == ["unpublish-1", "unstage-1", "unpublish-2", "unpublish-3"]
        assert slots.busy == 0 and slots.waiting == 0

    asyncio.run(main())


class _CrashingNode:
    """A CSI node service whose unstage dies half-way, as a driver killed after the unmount."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def NodeUnstageVolume(self, *_a: Any, **_kw: Any) -> None:
        self.calls.append("unstage")
        raise RuntimeError("rpc error: code = Unavailable desc = Stream removed (Socket closed)")


def test_an_interrupted_unstage_leaves_the_staging_to_be_staged_again(tmp_path: Path) -> None:
    """Found by the chaos campaign: a node plugin killed during NodeUnstageVolume (after its
    unmount) left the volume recorded as staged, and the next pod's publish failed forever with
    'globalmount is not mounted; call NodeStageVolume again'; once that was fixed, a claim waiting
    for its offline growth never saw its node expansion finished."""

    async def main() -> None:
        key = (DRIVER, "v1")
        a = agent(tmp_path, 1)
        node = _CrashingNode()
        conn = cast(Any, type("Conn", (), {"node": node})())
        cast(dict[str, Plugin], a.volumes.plugins)[DRIVER] = Plugin(
            DRIVER, conn, "node-a", True, False, {}, 0
        )
        actual = a.volumes.actual
        actual.mark_device_as_mounted(key)
        actual.mark_for_in_use_expansion_error(key)  # an expansion waiting for the volume to be unstaged
        with pytest.raises(RuntimeError):
            await a.volumes.generator.unstage(key)
        assert node.calls == ["unstage"]
        assert actual.get_device_mount_state(key) is DeviceMountState.UNCERTAIN, (
            "the next mount stages the volume again"
        )
        assert not actual.has_in_use_expansion_error(key), (
            "that stage grows it offline, so the node expansion is finished afterwards"
        )

    asyncio.run(main())
