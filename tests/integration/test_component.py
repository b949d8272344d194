"""The shared controller scaffolding: readiness follows the controller's sync, leader election
gates the controller, and cancellation closes everything."""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable

import pytest

from controller_runtime import process
from controller_runtime.client import ApiClient
from controller_runtime.component import serve_controller
from controller_runtime.controller import ControllerContext
from controller_runtime.counterpart import Counterpart
from controller_runtime.events import EventRecorder
from controller_runtime.health import HealthServer
from controller_runtime.resources import LEASES
from localstack.controlplane import ControlPlane
from tests.support.waits import eventually_async

pytestmark = pytest.mark.integration


class Dummy:
    def __init__(self) -> None:
        self.synced = False
        self.started = asyncio.Event()

    async def run(self) -> None:
        self.started.set()
        await asyncio.sleep(0.2)
        self.synced = True
        await asyncio.Event().wait()


def parse(control_plane: ControlPlane, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    process.add_controller_flags(parser, resync_period=0.0, resync_help="")
    return parser.parse_args([f"--kubeconfig={control_plane.admin_kubeconfig}", *extra])


def readiness(ctx: process.Context) -> str | None:
    assert ctx.health is not None
    checks = ctx.health._readiness  # the check serve_controller registered
    reason = checks["informers"]()
    assert reason is None or isinstance(reason, str), "serve_controller's check is synchronous"
    return reason


def ctx_ready(ctx: process.Context) -> Callable[[], Awaitable[bool]]:
    async def ready() -> bool:
        return readiness(ctx) is None

    return ready


@pytest.mark.parametrize("elected", [False, True])
async def test_serve_controller_readiness_and_election(control_plane: ControlPlane, elected: bool) -> None:
    extra = ["--leader-election", "--leader-election-namespace=default"] if elected else []
    args = parse(control_plane, *extra)
    ctx = process.Context(health=HealthServer("127.0.0.1:0"))
    dummy = Dummy()
    built: list[ControllerContext] = []

    def build(context: ControllerContext) -> Dummy:
        built.append(context)
        return dummy

    task = asyncio.create_task(
        serve_controller(
            args,
            ctx,
            user_agent="kubeloop-test",
            event_source="test",
            lease_name=f"test-{uuid.uuid4().hex[:8]}",
            build=build,
        )
    )
    await asyncio.wait_for(dummy.started.wait(), 30)
    assert readiness(ctx) == "caches not synced"
    await eventually_async("ready", ctx_ready(ctx), 2.5, 0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(built) == 1


async def test_a_guarded_controller_stands_down_and_keeps_its_lease(control_plane: ControlPlane) -> None:
    """With a Counterpart, kcm's first Event of that counterpart's source (written here under
    kcm's field manager) stops the controller; the process stays live, not ready, still leading."""
    lease = f"test-{uuid.uuid4().hex[:8]}"
    source = f"test-kcm-{uuid.uuid4().hex[:8]}"  # no other test's Events share it
    args = parse(control_plane, "--leader-election", "--leader-election-namespace=default")
    ctx = process.Context(health=HealthServer("127.0.0.1:0"))
    stopped = asyncio.Event()

    class Guarded(Dummy):
        async def run(self) -> None:
            try:
                await super().run()
            finally:
                stopped.set()

    dummy = Guarded()
    task = asyncio.create_task(
        serve_controller(
            args,
            ctx,
            lambda _context: dummy,
            user_agent="kubeloop-test",
            event_source="test",
            lease_name=lease,
            counterpart=Counterpart("test-controller", source),
        )
    )
    kcm = await ApiClient.from_kubeconfig(
        str(control_plane.admin_kubeconfig), qps=0, burst=1, user_agent="kube-controller-manager/v1.36.3"
    )
    try:
        await asyncio.wait_for(dummy.started.wait(), 30)
        # Ready once the guard's Events informer has listed too: what comes after is news.
        await eventually_async("ready", ctx_ready(ctx), 30, 0.05)
        recorder = EventRecorder(kcm, source)
        recorder.normal(
            {"kind": "Node", "apiVersion": "v1", "metadata": {"name": "n", "uid": "u"}}, "Seen", "x"
        )
        await recorder.flush()
        await asyncio.wait_for(stopped.wait(), 30)
        reason = readiness(ctx)
        assert reason is not None and reason.startswith(
            "standing down: kube-controller-manager's test-controller"
        )
        assert ctx.health is not None and not task.done()
        held = await kcm.get(LEASES, lease, "default")
        assert held["spec"]["holderIdentity"].endswith(f"_{os.getpid()}")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kcm.close()
