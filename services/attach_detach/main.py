"""`kubeloop-attach-detach-controller`: kcm's attach-detach controller as its own process."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial

from controller_runtime import process
from controller_runtime.component import serve_controller
from controller_runtime.counterpart import ATTACH_DETACH
from controller_runtime.logs import get_logger

from .controller import AttachDetachController, Options

log = get_logger("attach-detach")

COMPONENT = "attachdetach-controller"
NAME = "kubeloop-attach-detach-controller"  # its prog, user agent and Lease


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=NAME,
        description="Attaches and detaches volumes of the pods scheduled on each node (kcm's attachdetach).",
    )
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
        help="how long a volume still in use on a node that is not Ready (or deleted) is kept attached "
        "before it is force-detached (default: 6m)",
    )
    parser.add_argument(
        "--attach-detach-reconcile-sync-period",
        type=process.duration,
        default=60.0,
        help="how often volumes that nodes list as attached without a VolumeAttachment are checked "
        "(default: 1m)",
    )
    process.add_controller_flags(
        parser,
        resync_period=0.0,
        resync_help="informer resync period; 0 disables (default: 0)",
        qps=20.0,  # kube-controller-manager's client defaults
        burst=30,
    )
    return parser


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    options = Options(
        loop_period=args.reconciler_sync_period,
        max_wait_for_unmount=args.max_wait_for_unmount,
        sync_states_period=args.attach_detach_reconcile_sync_period,
    )
    build = partial(AttachDetachController, options=options)
    await serve_controller(
        args, ctx, build, user_agent=NAME, event_source=COMPONENT, lease_name=NAME, counterpart=ATTACH_DETACH
    )


def main(argv: Sequence[str] | None = None) -> None:
    process.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
