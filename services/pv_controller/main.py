"""`kubeloop-pv-controller`: kube-controller-manager's persistentvolume-binder as its own process."""

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

from . import names
from .controller import Options, PVController

log = get_logger("pv-controller")

LEASE_NAME = "kubeloop-pv-controller"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubeloop-pv-controller",
        description="Binds PersistentVolumeClaims to PersistentVolumes (kcm's persistentvolume-binder).",
    )
    # kube-controller-manager's client defaults.
    process.add_kube_flags(parser, qps=20.0, burst=30)
    parser.add_argument(
        "--resync-period",
        type=process.duration,
        default=15.0,
        help="how often every volume and claim is synced again (default: 15s)",
    )
    parser.add_argument(
        "--worker-threads",
        type=int,
        default=Options.workers,
        help=f"concurrent syncs per queue (volumes and claims) (default: {Options.workers})",
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
        user_agent="kubeloop-pv-controller",
    )
    recorder = EventRecorder(client, names.COMPONENT)
    leading = asyncio.Event()
    controller: PVController | None = None

    def ready() -> str | None:
        if args.leader_election and not leading.is_set():
            return None  # a standby is ready: it serves nothing until it leads
        if controller is None or not controller.synced:
            return "caches not synced"
        return None

    if ctx.health is not None:
        ctx.health.add_liveness_check("ping", lambda: None)
        ctx.health.add_readiness_check("informers", ready)

    async def lead() -> None:
        nonlocal controller
        leading.set()
        factory = SharedInformerFactory(client, resync_period=args.resync_period)
        controller = PVController(
            client,
            factory,
            recorder,
            Options(resync_period=args.resync_period, workers=max(1, args.worker_threads)),
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
