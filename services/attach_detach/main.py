"""`kubeloop-attach-detach-controller`: kcm's attach-detach controller as its own process."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from collections.abc import Sequence

from controller_runtime import process
from controller_runtime.client import ApiClient
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.leaderelection import LeaderElectionConfig, LeaderElector
from controller_runtime.logs import get_logger

from .controller import AttachDetachController, Options

log = get_logger("attach-detach")

COMPONENT = "attachdetach-controller"
LEASE_NAME = "kubeloop-attach-detach-controller"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubeloop-attach-detach-controller",
        description="Attaches and detaches volumes of the pods scheduled on each node (kcm's attachdetach).",
    )
    process.add_kube_flags(parser, qps=20.0, burst=30)
    parser.add_argument(
        "--reconciler-sync-period",
        type=process.duration,
        default=0.1,
        help="interval between reconcile passes (default: 100ms)",
    )
    parser.add_argument(
        "--max-wait-for-unmount",
        type=process.duration,
        default=360.0,
        help="how long a volume still in use on a node that is not Ready is kept attached before it is "
        "force-detached (default: 6m)",
    )
    parser.add_argument(
        "--resync-period",
        type=process.duration,
        default=0.0,
        help="informer resync period; 0 disables (default: 0)",
    )
    process.add_http_flags(parser)
    process.add_leader_election_flags(parser)
    process.add_logging_flags(parser)
    return parser


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    client = await ApiClient.from_kubeconfig(
        args.kubeconfig or None,
        qps=args.kube_api_qps,
        burst=args.kube_api_burst,
        user_agent="kubeloop-attach-detach-controller",
    )
    recorder = EventRecorder(client, COMPONENT)
    leading = asyncio.Event()
    controller: AttachDetachController | None = None

    def ready() -> str | None:
        if args.leader_election and not leading.is_set():
            return None
        return None if controller is not None and controller.synced else "caches not synced"

    if ctx.health is not None:
        ctx.health.add_liveness_check("ping", lambda: None)
        ctx.health.add_readiness_check("informers", ready)

    async def lead() -> None:
        nonlocal controller
        leading.set()
        controller = AttachDetachController(
            client,
            SharedInformerFactory(client, resync_period=args.resync_period),
            recorder,
            Options(loop_period=args.reconciler_sync_period, max_wait_for_unmount=args.max_wait_for_unmount),
        )
        await controller.run()

    try:
        if args.leader_election:
            elector = LeaderElector(
                client,
                LeaderElectionConfig(
                    namespace=args.leader_election_namespace,
                    name=LEASE_NAME,
                    identity=f"{socket.gethostname()}_{os.getpid()}",
                    lease_duration=args.leader_election_lease_duration,
                    renew_deadline=args.leader_election_renew_deadline,
                    retry_period=args.leader_election_retry_period,
                ),
            )
            await elector.run(lead)
        else:
            await lead()
    finally:
        await recorder.close()
        await client.close()


def main(argv: Sequence[str] | None = None) -> None:
    process.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
