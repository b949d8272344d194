"""`kubeloop-pv-controller`: kube-controller-manager's persistentvolume-binder as its own process."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial

from controller_runtime import process
from controller_runtime.component import serve_controller
from controller_runtime.counterpart import BINDER
from controller_runtime.logs import get_logger

from . import names
from .controller import Options, PVController

log = get_logger("pv-controller")

NAME = "kubeloop-pv-controller"  # its prog, user agent and Lease


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=NAME,
        description="Binds PersistentVolumeClaims to PersistentVolumes (kcm's persistentvolume-binder).",
    )
    parser.add_argument(
        "--worker-threads",
        type=int,
        default=Options.workers,
        help=f"concurrent syncs per queue (volumes and claims) (default: {Options.workers})",
    )
    parser.add_argument(
        "--binds-in-flight",
        type=int,
        default=Options.binds_in_flight,
        help="new binds whose writes may be in flight at once: 1 (kcm's single claim worker) keeps "
        "each bind as short as kcm's, more trade its latency for throughput; unthrottled, a bind's "
        f"last write overlaps the next bind's first (default: {Options.binds_in_flight})",
    )
    process.add_controller_flags(
        parser,
        resync_period=15.0,
        resync_help="how often every volume and claim is synced again (default: 15s)",
        qps=20.0,  # kube-controller-manager's client defaults
        burst=30,
    )
    return parser


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    options = Options(
        resync_period=args.resync_period,
        workers=max(1, args.worker_threads),
        binds_in_flight=max(1, args.binds_in_flight),
    )
    build = partial(PVController, options=options)
    await serve_controller(
        args, ctx, build, user_agent=NAME, event_source=names.COMPONENT, lease_name=NAME, counterpart=BINDER
    )


def main(argv: Sequence[str] | None = None) -> None:
    process.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
