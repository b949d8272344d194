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
) -> None:
    """Builds the controller once leading, from an informer factory resyncing every
    --resync-period (see process.add_controller_flags), and runs it until cancelled. /readyz fails
    until its caches are synced; a standby waiting for the Lease counts as ready (it serves nothing)."""
    client = await api_client(args, user_agent)
    recorder = EventRecorder(client, event_source)
    leading = asyncio.Event()
    running: list[Controller] = []

    def ready() -> str | None:
        if getattr(args, "leader_election", False) and not leading.is_set():
            return None
        return None if running and running[0].synced else "caches not synced"

    if ctx.health is not None:
        ctx.health.add_liveness_check("ping", lambda: None)
        ctx.health.add_readiness_check("informers", ready)

    async def lead() -> None:
        leading.set()
        factory = SharedInformerFactory(client, resync_period=args.resync_period)
        built = build(ControllerContext(client, factory, recorder))
        controller = await built if isinstance(built, Awaitable) else built
        running.append(controller)
        await controller.run()

    try:
        await run_elected(args, client, lease_name, lead)
    finally:
        await recorder.close()
        await client.close()
