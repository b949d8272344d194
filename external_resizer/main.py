"""`kubeloop-external-resizer`: the CSI external-resizer sidecar as a process."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from functools import partial

from controller_runtime import process
from controller_runtime.component import serve_controller
from controller_runtime.csi_client import CSIConnection

from .controller import Options, ResizerProcess, lease_name

NAME = "kubeloop-external-resizer"  # its prog and user agent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=NAME,
        description="Expands CSI volumes whose PersistentVolumeClaim asks for more storage "
        "(kubernetes-csi external-resizer): ControllerExpandVolume, the PV's capacity, and the "
        "claim's resize status, leaving a filesystem to grow to the node when the driver says so. "
        "When the driver can modify volumes (MODIFY_VOLUME), also applies a claim's new "
        "VolumeAttributesClass: ControllerModifyVolume, the PV's class and the claim's "
        "currentVolumeAttributesClassName and modifyVolumeStatus.",
    )
    process.add_csi_flags(parser, timeout=10.0)
    parser.add_argument("--workers", type=int, default=10, help="concurrent claim syncs (default: 10)")
    parser.add_argument(
        "--retry-interval-start",
        type=process.duration,
        default=1.0,
        help="first retry delay after a failed resize (default: 1s)",
    )
    parser.add_argument(
        "--retry-interval-max",
        type=process.duration,
        default=300.0,
        help="longest retry delay; an infeasible size is retried once per this interval (default: 5m)",
    )
    process.add_bool_flag(
        parser,
        "--handle-volume-inuse-error",
        True,
        "after the driver answers FAILED_PRECONDITION (volume in use), wait until no running pod uses "
        "the claim before trying again; watches pods",
    )
    process.add_bool_flag(
        parser,
        "--extra-modify-metadata",
        False,
        "add the claim's name and namespace and the PV's name to the parameters ControllerModifyVolume "
        "gets (csi.storage.k8s.io/pvc/name, .../pvc/namespace, .../pv/name)",
    )
    process.add_bool_flag(
        parser,
        "--node-deployment",
        False,
        "run beside the driver on every node (node name from $NODE_NAME) and expand only the volumes "
        "whose node affinity that Node's labels satisfy (a kubeloop extension: node-local volumes "
        "are reachable from their node's driver only); excludes --leader-election",
    )
    process.add_controller_flags(parser)
    return parser


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
    options = Options(
        workers=max(1, args.workers),
        timeout=args.timeout,
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
    process.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
