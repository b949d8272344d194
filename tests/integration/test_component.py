"""The shared controller scaffolding: readiness follows the controller's sync, leader election
gates the controller, and cancellation closes everything."""

from __future__ import annotations

import argparse
import asyncio
import uuid

import pytest

from controller_runtime import process
from controller_runtime.component import serve_controller
from controller_runtime.controller import ControllerContext
from controller_runtime.health import HealthServer
from localstack.controlplane import ControlPlane

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
    for _ in range(50):
        if readiness(ctx) is None:
            break
        await asyncio.sleep(0.05)
    assert readiness(ctx) is None
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(built) == 1
