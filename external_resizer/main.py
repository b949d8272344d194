"""`kubeloop-external-resizer`: the CSI external-resizer sidecar as a process."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from functools import partial

from controller_runtime import goflags, process
from controller_runtime.component import serve_controller
from controller_runtime.csi_client import CSIConnection

from .controller import Options, ResizerProcess, lease_name

NAME = "kubeloop-external-resizer"  # its prog and user agent


# The counterpart whose command line this one takes (tools/versions.env's EXTERNAL_RESIZER_VERSION).
UPSTREAM = "external-resizer v2.3.0"
RETRY_MAX_HELP = "longest retry delay; an infeasible size is retried once per this interval"


def build_parser() -> goflags.FlagSet:
    """Every flag of upstream's csi-resizer, parsed as Go's flag package does, and kubeloop's own
    --node-deployment (docs/sidecar-flags.md)."""
    flags = goflags.controller_sidecar(
        NAME,
        "Expands CSI volumes whose PersistentVolumeClaim asks for more storage "
        "(kubernetes-csi external-resizer): ControllerExpandVolume, the PV's capacity, and the "
        "claim's resize status, leaving a filesystem to grow to the node when the driver says so. "
        "When the driver can modify volumes (MODIFY_VOLUME), also applies a claim's new "
        "VolumeAttributesClass: ControllerModifyVolume, the PV's class and the claim's "
        "currentVolumeAttributesClassName and modifyVolumeStatus.",
        goflags.Syntax.GO,
        UPSTREAM,
    )
    Flag, S = goflags.Flag, goflags.Support
    flags.add(
        goflags.MASTER,
        *goflags.retry_flags("first retry delay after a failed resize", RETRY_MAX_HELP),
        Flag(
            "timeout",
            "duration",
            "10s",
            "timeout of the calls to the driver; given, it is also the timeout of ControllerExpandVolume "
            "and ControllerModifyVolume, whatever --resize-timeout and --modify-timeout say",
        ),
        Flag(
            "resize-timeout",
            "duration",
            "10s",
            "timeout of ControllerExpandVolume, unless --timeout is given",
        ),
        Flag(
            "modify-timeout",
            "duration",
            "10s",
            "timeout of ControllerModifyVolume, unless --timeout is given",
        ),
        Flag("workers", "int", "10", "concurrent claim syncs"),
        Flag("resync-period", "duration", "10m0s", "informer resync period"),
        Flag(
            "handle-volume-inuse-error",
            "bool",
            "true",
            "after the driver answers FAILED_PRECONDITION (volume in use), wait until no running pod uses "
            "the claim before trying again; watches pods",
        ),
        Flag(
            "extra-modify-metadata",
            "bool",
            "false",
            "add the claim's name and namespace and the PV's name to the parameters ControllerModifyVolume "
            "gets (csi.storage.k8s.io/pvc/name, .../pvc/namespace, .../pv/name)",
        ),
        Flag(
            "node-deployment",
            "bool",
            "false",
            "run beside the driver on every node (node name from $NODE_NAME) and expand only the volumes "
            "whose node affinity that Node's labels satisfy (node-local volumes are reachable from their "
            "node's driver only); excludes --leader-election",
            S.OWN,
        ),
    )
    flags.add_gates(
        goflags.Gate(
            "AnnotateFsResize",
            True,
            "BETA",
            kubeloop=True,
            why="kubeloop's resizer always keeps the size before a resize that the node finishes in the "
            "PV's volume.alpha.kubernetes.io/pre-resize-capacity annotation",
        ),
        goflags.Gate(
            "VolumeAttributesClass",
            True,
            "GA",
            kubeloop=True,
            why="kubeloop's resizer always applies a claim's VolumeAttributesClass when the driver can "
            "modify volumes",
        ),
        goflags.RELEASE_ON_EXIT,
        *goflags.apiserver_gates("v0.37"),
    )
    return flags


def operation_timeouts(args: argparse.Namespace) -> tuple[float, float]:
    """ControllerExpandVolume's and ControllerModifyVolume's timeouts: --timeout when it is given,
    else --resize-timeout and --modify-timeout (upstream's resolveOperationTimeouts)."""
    if "timeout" in args.given:
        return args.timeout, args.timeout
    return args.resize_timeout, args.modify_timeout


def node_name(args: argparse.Namespace) -> str | None:
    """$NODE_NAME for --node-deployment (None without it); refuses what cannot work."""
    if not args.node_deployment:
        return None
    name = os.environ.get("NODE_NAME", "")
    if not name:
        raise SystemExit(
            f"{NAME}: The NODE_NAME environment variable must be set when using --node-deployment."
        )
    if args.leader_election:
        # One Lease for the driver would leave a single node's resizer expanding, and it can reach
        # its own node's volumes only.
        raise SystemExit(
            f"{NAME}: --leader-election cannot be used with --node-deployment: "
            "each node's resizer serves its own node"
        )
    return name


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    resize_timeout, modify_timeout = operation_timeouts(args)
    options = Options(
        workers=max(1, args.workers),
        timeout=resize_timeout,
        modify_timeout=modify_timeout,
        retry_start=args.retry_interval_start,
        retry_max=args.retry_interval_max,
        handle_volume_in_use_error=args.handle_volume_inuse_error,
        extra_modify_metadata=args.extra_modify_metadata,
        node_name=node_name(args),
    )
    async with await CSIConnection.connect(args.csi_address, timeout=args.timeout) as csi:
        build = partial(ResizerProcess, csi=csi, options=options)
        source, lease = f"external-resizer {csi.driver_name}", lease_name(csi.driver_name)
        await serve_controller(args, ctx, build, user_agent=NAME, event_source=source, lease_name=lease)


def main(argv: Sequence[str] | None = None) -> None:
    goflags.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
