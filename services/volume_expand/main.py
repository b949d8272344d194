"""`kubeloop-volume-expand-controller`: kube-controller-manager's persistentvolume-expander as its
own process."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial

from controller_runtime import process
from controller_runtime.component import serve_controller
from controller_runtime.counterpart import EXPANDER

from .controller import COMPONENT, ExpandController, Options

NAME = "kubeloop-volume-expand-controller"  # its prog, user agent and Lease


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=NAME,
        description="Watches bound PersistentVolumeClaims whose request grew past their capacity and "
        "hands them to the external resizer (kcm's persistentvolume-expander): checks the PV is bound "
        "to the claim and records an ExternalExpanding event.",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=Options.workers,
        help=f"concurrent claim syncs (default: {Options.workers})",
    )
    process.add_controller_flags(
        parser,
        resync_period=0.0,
        resync_help="informer resync period; a resync alone never repeats an event (default: 0, off)",
        qps=20.0,  # kube-controller-manager's client defaults
        burst=30,
    )
    return parser


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    build = partial(ExpandController, options=Options(workers=max(1, args.workers)))
    await serve_controller(
        args, ctx, build, user_agent=NAME, event_source=COMPONENT, lease_name=NAME, counterpart=EXPANDER
    )


def main(argv: Sequence[str] | None = None) -> None:
    process.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
