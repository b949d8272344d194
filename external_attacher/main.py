"""`kubeloop-external-attacher`: the CSI external-attacher sidecar as a process."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial

from controller_runtime import process
from controller_runtime.component import serve_controller
from controller_runtime.csi_client import CSIConnection
from controller_runtime.logs import get_logger

from .controller import Attacher, Options

log = get_logger("external-attacher")

NAME = "kubeloop-external-attacher"  # its prog and user agent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=NAME,
        description="Attaches and detaches CSI volumes for VolumeAttachments "
        "(kubernetes-csi external-attacher).",
    )
    process.add_csi_flags(parser, timeout=15.0)
    parser.add_argument(
        "--worker-threads", type=int, default=10, help="concurrent VolumeAttachment syncs (default: 10)"
    )
    process.add_retry_flags(parser)
    parser.add_argument(
        "--reconcile-sync",
        type=process.duration,
        default=60.0,
        help="how often ListVolumes' published nodes are compared with the VolumeAttachments; "
        "0 disables (default: 1m)",
    )
    process.add_controller_flags(parser)
    return parser


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    options = Options(
        workers=max(1, args.worker_threads),
        timeout=args.timeout,
        retry_start=args.retry_interval_start,
        retry_max=args.retry_interval_max,
        reconcile_sync=args.reconcile_sync,
    )
    async with await CSIConnection.connect(args.csi_address, timeout=args.timeout) as csi:
        # One lease per driver, named like the Go sidecar's (driver with dots replaced).
        lease = "external-attacher-leader-" + csi.driver_name.replace(".", "-").replace("/", "-")
        build = partial(Attacher, csi=csi, options=options)
        await serve_controller(
            args, ctx, build, user_agent=NAME, event_source="external-attacher", lease_name=lease
        )


def main(argv: Sequence[str] | None = None) -> None:
    process.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
