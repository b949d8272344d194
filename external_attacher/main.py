"""`kubeloop-external-attacher`: the CSI external-attacher sidecar as a process."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial

from controller_runtime import goflags, process
from controller_runtime.component import serve_controller
from controller_runtime.csi_client import CSIConnection
from controller_runtime.logs import get_logger

from .controller import Attacher, Options

log = get_logger("external-attacher")

NAME = "kubeloop-external-attacher"  # its prog and user agent


# The counterpart whose command line this one takes (tools/versions.env's EXTERNAL_ATTACHER_VERSION).
UPSTREAM = "external-attacher v4.13.0"


def build_parser() -> goflags.FlagSet:
    """Every flag of upstream's csi-attacher, parsed as Go's flag package does (docs/sidecar-flags.md)."""
    flags = goflags.controller_sidecar(
        NAME,
        "Attaches and detaches CSI volumes for VolumeAttachments (kubernetes-csi external-attacher).",
        goflags.Syntax.GO,
        UPSTREAM,
    )
    Flag, S = goflags.Flag, goflags.Support
    flags.add(
        *goflags.retry_flags(),
        Flag(
            "timeout",
            "duration",
            "15s",
            "timeout of each ControllerPublishVolume and ControllerUnpublishVolume",
        ),
        Flag("worker-threads", "uint", "10", "concurrent VolumeAttachment syncs"),
        Flag("resync", "duration", "10m0s", "informer resync period", dest="resync_period"),
        Flag(
            "reconcile-sync",
            "duration",
            "1m0s",
            "how often ListVolumes' published nodes are compared with the VolumeAttachments; 0 disables",
        ),
        Flag(
            "default-fstype",
            "string",
            "",
            "filesystem type passed to ControllerPublishVolume for a filesystem volume whose PV names none",
        ),
        Flag(
            "max-entries",
            "int",
            "0",
            "entries per ListVolumes page; 0 lets the driver choose",
            S.IGNORED,
            "kubeloop's reconciler reads every page ListVolumes returns, whatever their size",
        ),
        Flag(
            "max-grpc-log-length",
            "int",
            "-1",
            "characters of each gRPC response logged",
            S.IGNORED,
            "kubeloop does not log gRPC responses",
        ),
    )
    flags.add_gates(
        goflags.Gate(
            "MutableCSINodeAllocatableCount",
            True,
            "GA",
            why="on: a failed attach's attachError carries the gRPC code (errorCode), which kubelet reads",
        ),
        goflags.RELEASE_ON_EXIT,
        *goflags.apiserver_gates("v0.37"),
    )
    return flags


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    options = Options(
        workers=max(1, args.worker_threads),
        timeout=args.timeout,
        retry_start=args.retry_interval_start,
        retry_max=args.retry_interval_max,
        reconcile_sync=args.reconcile_sync,
        default_fstype=args.default_fstype,
        error_code=args.gates["MutableCSINodeAllocatableCount"],
    )
    async with await CSIConnection.connect(args.csi_address, timeout=args.timeout) as csi:
        # One lease per driver, named like the Go sidecar's (driver with dots replaced).
        lease = "external-attacher-leader-" + csi.driver_name.replace(".", "-").replace("/", "-")
        build = partial(Attacher, csi=csi, options=options)
        await serve_controller(
            args, ctx, build, user_agent=NAME, event_source="external-attacher", lease_name=lease
        )


def main(argv: Sequence[str] | None = None) -> None:
    goflags.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
