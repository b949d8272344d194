"""`kubeloop-node-finalizer`: TopoLVM's node finalizer for loop.csi.kubeloop.dev's node-local
volumes, as its own process."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial

from controller_runtime import process
from controller_runtime.component import serve_controller

from .controller import NodeFinalizer, Options
from .decide import DRIVER_NAME, FINALIZER

NAME = "kubeloop-node-finalizer"  # its prog, user agent, event source and Lease


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=NAME,
        description=f"Puts the finalizer {FINALIZER} on every Node; when a Node is deleted, deletes "
        f"the claims bound to the node-local volumes of {DRIVER_NAME} pinned to it and those volumes "
        "(reclaim policy Delete; their pool went with the machine), with events saying so, and then "
        "lets the Node go. A Node that is only NotReady is never touched.",
    )
    process.add_bool_flag(
        parser,
        "--skip-node-finalize",
        False,
        "on Node deletion clean nothing up, only remove the finalizer (the claims and volumes pinned "
        "to the node are left for the admin), as TopoLVM's flag",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=Options.workers,
        help=f"concurrent Node syncs (default: {Options.workers})",
    )
    process.add_controller_flags(parser)
    return parser


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    options = Options(workers=max(1, args.workers), skip_node_finalize=args.skip_node_finalize)
    build = partial(NodeFinalizer, options=options)
    await serve_controller(args, ctx, build, user_agent=NAME, event_source=NAME, lease_name=NAME)


def main(argv: Sequence[str] | None = None) -> None:
    process.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
