"""The scaffolding every API-watching kubeloop process shares, so each main.py only says what is
its own: the API client from the kube flags, an event recorder, liveness and readiness checks, and
running the controller either directly or only while it holds its leader-election Lease."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from .client import ApiClient
from .controller import ControllerContext
from .counterpart import Counterpart, CounterpartGuard
from .events import EventRecorder
from .informer import SharedInformerFactory
from .leaderelection import LeaderElectionConfig, LeaderElector
from .process import Context


class Controller(Protocol):
    @property
    def synced(self) -> bool: ...

    async def run(self) -> None: ...


async def api_client(args: argparse.Namespace, user_agent: str) -> ApiClient:
    """The client described by add_kube_flags' flags."""
    return await ApiClient.from_kubeconfig(
        args.kubeconfig or None, qps=args.kube_api_qps, burst=args.kube_api_burst, user_agent=user_agent
    )


async def run_elected(
    args: argparse.Namespace,
    client: ApiClient,
    lease_name: str,
    lead: Callable[[], Coroutine[Any, Any, None]],
) -> None:
    """Runs `lead` at once, or with --leader-election only while holding the Lease `lease_name`."""
    if not getattr(args, "leader_election", False):
        await lead()
        return
    lease_client = client.with_own_limiter()
    elector = LeaderElector(
        lease_client,
        LeaderElectionConfig(
            namespace=args.leader_election_namespace,
            name=lease_name,
            identity=f"{socket.gethostname()}_{os.getpid()}",
            lease_duration=args.leader_election_lease_duration,
            renew_deadline=args.leader_election_renew_deadline,
            retry_period=args.leader_election_retry_period,
        ),
    )
    try:
        await elector.run(lead)
    finally:
        await lease_client.close()


async def serve_controller(
    args: argparse.Namespace,
    ctx: Context,
    build: Callable[[ControllerContext], Controller | Awaitable[Controller]],
    *,
    user_agent: str,
    event_source: str,
    lease_name: str,
    counterpart: Counterpart | None = None,
) -> None:
    """Builds the controller once leading, from an informer factory resyncing every
    --resync-period (see process.add_controller_flags), and runs it until cancelled. /readyz fails
    until its caches are synced; a standby waiting for the Lease counts as ready (it serves nothing).

    With `counterpart` (kcm's controller this one replaces), a CounterpartGuard watches for it
    while leading; once kcm's is seen writing, the controller's client writes nothing more, the
    controller and its informers stop, and the process stays up, live but not ready, holding its
    Lease (so no standby takes over and writes either) until it is stopped."""
    client = await api_client(args, user_agent)
    recorder = EventRecorder(client, event_source)
    leading = asyncio.Event()
    running: list[Controller] = []
    guard = CounterpartGuard(counterpart, user_agent, client) if counterpart is not None else None

    def ready() -> str | None:
        if guard is not None and guard.reason is not None:
            return guard.reason
        if getattr(args, "leader_election", False) and not leading.is_set():
            return None
        synced = running and running[0].synced and (guard is None or guard.synced)
        return None if synced else "caches not synced"

    if ctx.health is not None:
        ctx.health.add_liveness_check("ping", lambda: None)
        ctx.health.add_readiness_check("informers", ready)

    async def lead() -> None:
        leading.set()
        factory = SharedInformerFactory(client, resync_period=args.resync_period)
        built = build(ControllerContext(client, factory, recorder))
        controller = await built if isinstance(built, Awaitable) else built
        running.append(controller)
        if guard is None:
            await controller.run()
            return
        guard.watch(factory)
        guard.start()
        await _run_guarded(controller, factory, guard)

    try:
        await run_elected(args, client, lease_name, lead)
    finally:
        if guard is not None:
            await guard.close()
        await recorder.close()
        await client.close()


async def _run_guarded(
    controller: Controller, factory: SharedInformerFactory, guard: CounterpartGuard
) -> None:
    """Runs the controller until it ends or the guard trips; then stops it and its informers and
    waits, writing nothing, until cancelled (the process's stop)."""
    work = asyncio.ensure_future(controller.run())
    tripped = asyncio.ensure_future(guard.tripped.wait())
    try:
        await asyncio.wait({work, tripped}, return_when=asyncio.FIRST_COMPLETED)
        if not guard.tripped.is_set():
            await work  # it ended on its own: its result or its error
            return
        work.cancel()
        # Whatever the controller says on its way out (a write refused) changes nothing now.
        await asyncio.gather(work, return_exceptions=True)
        await asyncio.gather(factory.stop(), guard.stop())
        await asyncio.Event().wait()  # stand down until the process stops
    finally:
        for task in (work, tripped):
            task.cancel()
        await asyncio.gather(work, tripped, return_exceptions=True)
