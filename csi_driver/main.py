"""`kubeloop-csi-driver`: the CSI plugin loop.csi.kubeloop.dev as a process.

    kubeloop-csi-driver --mode all --endpoint unix:///run/kubeloop/csi.sock --node-id node-1 \\
        --pool-dir /var/lib/kubeloop/pool --state-dir /var/lib/kubeloop/state

On a cluster of separate machines each node runs it with `--mode all --node-local`: controller
and node service for that node's own pool.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from controller_runtime import process
from controller_runtime.driver_names import topology_key
from controller_runtime.health import HealthServer
from controller_runtime.logs import get_logger
from controller_runtime.metrics import REGISTRY
from controller_runtime.plugin_registration import RegistrationServer
from controller_runtime.unix_grpc import socket_path, start_unix_server, stop_unix_server
from controller_runtime.version import VERSION
from kubeloop_grpc.csi import csi_pb2_grpc

from . import DRIVER_NAME
from .controller import ControllerConfig, ControllerServer
from .freeze import FreezeWatcher
from .group_controller import GroupControllerServer
from .identity import IdentityServer
from .node import NodeConfig, NodeServer
from .pool_kinds import capacity_of_node, parse_capacity, pool_capacity
from .pool_metrics import PoolMetrics
from .server import CsiInterceptor
from .snapshot_metadata import SnapshotMetadataServer
from .state import DriverState, NodeInfo
from .validation import TiB, check_id, parse_size

if TYPE_CHECKING:
    from .transfer.service import Transfers

log = get_logger("csi.main")


# Volumes a node plugin accepts unless told otherwise (--max-volumes-per-node).
MAX_VOLUMES_PER_NODE = 256


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _capacity(text: str) -> tuple[str, int]:
    try:
        return parse_capacity(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


# The CSI spec's rule for a plugin name: at most 63 characters, alphanumerics, '-' and '.', beginning
# and ending with an alphanumeric. kubelet also uses it as a directory name, so the rule matters here.
_DRIVER_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,61}[A-Za-z0-9])?")


def _driver_name(text: str) -> str:
    if not _DRIVER_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text[:100]!r} is not a CSI driver name: at most 63 letters, digits, '-' or '.', "
            "beginning and ending with a letter or digit"
        )
    return text


class _Parser(argparse.ArgumentParser):
    """Flags that depend on each other are checked as a parse error: the usage and exit status 2."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: None = None) -> argparse.Namespace:  # type: ignore[override]
        parsed = super().parse_args(args, namespace)
        parsed.capacity_from = "--capacity"
        if parsed.capacity_per_node is not None:
            try:
                own = capacity_of_node(parsed.capacity_per_node.read_text(), parsed.node_id)
            except (OSError, ValueError) as e:
                self.error(f"--capacity-per-node {parsed.capacity_per_node}: {e}")
            if own is not None:
                parsed.capacity, parsed.capacity_from = own, str(parsed.capacity_per_node)
        try:
            parsed.capacity = pool_capacity(parsed.capacity)
        except ValueError as e:
            self.error(str(e))
        if parsed.node_local and parsed.mode != "all":
            self.error(
                f"--node-local requires --mode all (got --mode {parsed.mode}): a node-local pool is "
                "served by the one process on its node, controller and node service together"
            )
        if parsed.transfer_port and not parsed.node_local:
            self.error(
                "--transfer-port requires --node-local: a shared pool is every node's already, "
                "there is nothing to transfer"
            )
        if not 0 <= parsed.transfer_port <= 65535:
            self.error(f"--transfer-port must be a TCP port or 0 (got {parsed.transfer_port})")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kubeloop-csi-driver",
        description=f"CSI plugin {DRIVER_NAME}: volumes are sparse files in a pool directory, attached as "
        "loop devices on the node that stages them.",
    )
    parser.add_argument(
        "--endpoint",
        default="unix:///run/kubeloop/csi.sock",
        help="CSI socket, unix:///path or a path (default: unix:///run/kubeloop/csi.sock)",
    )
    parser.add_argument(
        "--drivername",
        type=_driver_name,
        default=DRIVER_NAME,
        help="the name GetPluginInfo reports, which CSIDriver objects, StorageClasses and kubelet's "
        "registration use (csi-driver-host-path's flag; for running the driver in manifests written "
        f"for another driver's name; default: {DRIVER_NAME})",
    )
    parser.add_argument(
        "--mode",
        choices=["controller", "node", "all"],
        default="all",
        help="controller serves Identity+Controller, node serves Identity+Node, all serves "
        "both (default: all)",
    )
    parser.add_argument(
        "--node-local",
        action="store_true",
        help="the pool is this node's own (a cluster of separate machines; needs --mode all): "
        "volumes are accessible from --node-id only, GetCapacity answers for this node's topology "
        "segment, and the node stages without ControllerPublishVolume (CSIDriver attachRequired: "
        "false)",
    )
    parser.add_argument(
        "--node-id",
        default=socket.gethostname(),
        help="this node's id, reported by NodeGetInfo (default: the host name)",
    )
    parser.add_argument(
        "--pool-dir",
        type=Path,
        default=Path("/var/lib/kubeloop/pool"),
        help="directory of the sparse backing files, shared by the controller and the node "
        "plugins of this machine; with --node-local it must exist (default: /var/lib/kubeloop/pool)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path("/var/lib/kubeloop/csi-state"),
        help="where the driver keeps its durable records (default: /var/lib/kubeloop/csi-state)",
    )
    parser.add_argument(
        "--max-volume-size",
        type=_size,
        default=TiB,
        help="largest volume CreateVolume (and an inline ephemeral volume's size) accepts, e.g. 100Gi "
        "(default: 1Ti)",
    )
    parser.add_argument(
        "--capacity",
        type=_capacity,
        action="append",
        default=[],
        metavar="[KIND=]SIZE",
        help="capacity the pool offers, e.g. 50Gi; 0 reports the pool filesystem's free space "
        "(default: 0). KIND=SIZE (repeatable, e.g. --capacity fast=100Gi --capacity slow=1Ti) "
        "splits the pool into kinds that a StorageClass chooses with the parameter kind",
    )
    parser.add_argument(
        "--capacity-per-node",
        type=Path,
        default=None,
        metavar="FILE",
        help='a JSON object of node id to a list of [KIND=]SIZE, e.g. {"node-a": ["50Gi"]}: '
        "this node's entry (--node-id), when the file has one, replaces the --capacity flags "
        "(read at start; the Helm chart's capacityPerNode)",
    )
    parser.add_argument(
        "--max-volumes-per-node",
        type=int,
        default=MAX_VOLUMES_PER_NODE,
        help="volumes a node accepts, reported by NodeGetInfo; 0 is unlimited "
        f"(default: {MAX_VOLUMES_PER_NODE})",
    )
    parser.add_argument(
        "--direct-io",
        choices=["on", "off"],
        default="on",
        help="attach loop devices with direct I/O where the pool's filesystem supports it, "
        "so data is not cached twice (default: on)",
    )
    parser.add_argument(
        "--kubelet-dir",
        default="",
        help="kubelet's root directory (node and all modes): staging and target paths must lie "
        "under it (default: the --kubelet-root-dir, else /var/lib/kubelet)",
    )
    parser.add_argument(
        "--kubelet-registration-dir",
        default="",
        help="kubelet's plugins_registry directory; when set (node and all modes) the plugin "
        "serves the registration API on <dir>/<drivername>-reg.sock",
    )
    parser.add_argument(
        "--kubelet-root-dir",
        default="",
        help="kubelet's root directory; shorthand for --kubelet-dir <root> and "
        "--kubelet-registration-dir <root>/plugins_registry",
    )
    parser.add_argument(
        "--kubelet-registration-path",
        default="",
        help="the CSI socket path as kubelet sees it, reported by GetInfo (default: the --endpoint path)",
    )
    parser.add_argument(
        "--socket-group",
        type=int,
        default=None,
        help="a group id given the CSI socket, made 0660 instead of 0600: sidecars running as another "
        "user of that group may connect (kubeloop's manifests run theirs as 65532; default: none)",
    )
    parser.add_argument(
        "--grace-period",
        type=process.duration,
        default=10.0,
        help="how long SIGTERM waits for in-flight RPCs (default: 10s)",
    )
    transfer = parser.add_argument_group(
        "transfers between node-local pools (docs/transfer.md; all need --node-local and --transfer-port)"
    )
    transfer.add_argument(
        "--transfer-port",
        type=int,
        default=0,
        help="serve this pool's volumes and snapshots to the other nodes' plugins on this TCP port "
        "(TLS), pull restores' and clones' sources from them, and carry out moves "
        "(kubectl kubeloop move); 0 turns transfers off, and a source must be in this pool (default: 0)",
    )
    transfer.add_argument(
        "--transfer-address",
        default="0.0.0.0",
        help="the address the transfer server listens on (default: 0.0.0.0, every address of the pod)",
    )
    transfer.add_argument(
        "--transfer-token-file",
        type=Path,
        default=Path("/var/run/secrets/kubeloop-transfer/token"),
        help="this plugin's projected ServiceAccount token for --transfer-audience, bound to its pod "
        "(default: /var/run/secrets/kubeloop-transfer/token)",
    )
    transfer.add_argument(
        "--transfer-audience",
        default="",
        help="the audience peers' tokens must carry (default: transfer.<drivername>)",
    )
    transfer.add_argument(
        "--transfer-namespace",
        default=os.environ.get("POD_NAMESPACE", "kube-system"),
        help="the namespace of the node plugins' pods and of the TLS Secret (default: the env "
        "POD_NAMESPACE, else kube-system)",
    )
    transfer.add_argument(
        "--transfer-peers",
        default="app.kubernetes.io/name=kubeloop,app.kubernetes.io/component=csi-node",
        help="label selector of the node plugins' pods, whose pod IPs the peers are reached at "
        "(default: app.kubernetes.io/name=kubeloop,app.kubernetes.io/component=csi-node)",
    )
    transfer.add_argument(
        "--transfer-tls-secret",
        default="kubeloop-transfer-tls",
        help="the Secret holding the transfers' CA and serving pair, made by the first plugin that "
        "finds none (default: kubeloop-transfer-tls)",
    )
    transfer.add_argument(
        "--kubeconfig",
        default="",
        help="kubeconfig for the TokenReviews, peers and moves (default: the pod's service account)",
    )
    process.add_http_flags(parser)
    process.add_logging_flags(parser)
    return parser


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    controller_mode = args.mode in ("controller", "all")
    node_mode = args.mode in ("node", "all")
    if node_mode:
        check_id(args.node_id, "--node-id")
        args.kubelet_dir = args.kubelet_dir or args.kubelet_root_dir or "/var/lib/kubelet"
        os.makedirs(args.kubelet_dir, 0o750, exist_ok=True)
    state = DriverState(args.pool_dir, args.state_dir, create_pool=not args.node_local)
    if ctx.health is not None:
        ctx.health.add_readiness_check("driver", state.health_problem)
    try:
        await state.load()
        await _serve(args, state, controller_mode, node_mode, ctx.health)
    finally:
        state.close()


async def _serve(
    args: argparse.Namespace,
    state: DriverState,
    controller_mode: bool,
    node_mode: bool,
    health: HealthServer | None,
) -> None:
    transfers: Transfers | None = None
    identity = IdentityServer(state, controller=controller_mode, name=args.drivername)
    controller = node = None
    group: GroupControllerServer | None = None
    watcher: asyncio.Task[None] | None = None
    if controller_mode:
        controller = ControllerServer(
            state,
            ControllerConfig(
                max_volume_size=args.max_volume_size,
                capacity=args.capacity,
                local_node_id=args.node_id if node_mode else "",
                node_local=args.node_local,
                topology_key=topology_key(args.drivername),
                transfers=bool(args.transfer_port),
            ),
        )
        await controller.reconcile()
        group = GroupControllerServer(controller)
        if controller.holds_pool and health is not None:
            # The one process with the pool's controller side exports its gauges (a shared
            # pool's node plugins none): docs/observability.md, "The pool's gauges".
            pool_metrics = PoolMetrics(state, args.capacity, args.node_id if args.node_local else "")
            REGISTRY.register(pool_metrics)
            health.add_metrics_refresh(pool_metrics.refresh)
    if node_mode:
        node = NodeServer(
            state,
            NodeConfig(
                node_id=args.node_id,
                max_volumes_per_node=args.max_volumes_per_node,
                kubelet_dir=args.kubelet_dir,
                direct_io=args.direct_io == "on",
                node_local=args.node_local,
                max_volume_size=args.max_volume_size,
                driver_name=args.drivername,
                topology_key=topology_key(args.drivername),
            ),
        )
        await node.reconcile()
        await state.announce_node(NodeInfo(args.node_id, args.max_volumes_per_node))
        if not state.pool_problem():
            watcher = asyncio.create_task(FreezeWatcher(state, args.node_id).run(), name="freeze-watcher")
    if controller is not None and args.transfer_port:
        # Imported here: the API client it brings costs memory a plugin without transfers spares.
        from .transfer.access import TransferConfig
        from .transfer.service import start as start_transfers

        transfers = await start_transfers(
            args.kubeconfig,
            TransferConfig(
                node=args.node_id,
                port=args.transfer_port,
                address=args.transfer_address,
                namespace=args.transfer_namespace,
                peer_selector=args.transfer_peers,
                token_file=args.transfer_token_file,
                audience=args.transfer_audience or f"transfer.{args.drivername}",
                tls_secret=args.transfer_tls_secret,
                tls_dir=args.state_dir / "transfer-tls",
                server_name=f"transfer.{args.drivername}",
                topology_key=topology_key(args.drivername),
            ),
            controller,
            args.drivername,
        )
    state.mark_ready()

    def register(server: grpc.aio.Server) -> None:
        csi_pb2_grpc.add_IdentityServicer_to_server(identity, server)
        if controller is not None:
            csi_pb2_grpc.add_ControllerServicer_to_server(controller, server)
        if group is not None:
            csi_pb2_grpc.add_GroupControllerServicer_to_server(group, server)
            csi_pb2_grpc.add_SnapshotMetadataServicer_to_server(SnapshotMetadataServer(state), server)
        if node is not None:
            csi_pb2_grpc.add_NodeServicer_to_server(node, server)

    path = socket_path(args.endpoint)
    server = await start_unix_server(
        path, register, [CsiInterceptor(args.drivername)], group=args.socket_group
    )
    reg_server = None
    registration: RegistrationServer | None = None
    try:
        reg_dir = args.kubelet_registration_dir or (
            os.path.join(args.kubelet_root_dir, "plugins_registry") if args.kubelet_root_dir else ""
        )
        if node_mode and reg_dir:
            registration = RegistrationServer(args.drivername, args.kubelet_registration_path or path)
            reg_server = await registration.serve(reg_dir, [CsiInterceptor(args.drivername)])
        log.info(
            "CSI driver ready",
            driver=args.drivername,
            version=VERSION,
            mode=args.mode,
            node_local=args.node_local,
            node=args.node_id if node_mode else "",
            endpoint=path,
            capacity=args.capacity.total or dict(args.capacity.kinds) or "free space",
            capacity_from=args.capacity_from,
        )
        if registration is None:
            # Not server.wait_for_termination(): cancelling that (SIGTERM) cancels grpc's own
            # shutdown future, and the stop below would then raise instead of draining RPCs.
            await asyncio.get_running_loop().create_future()
        else:
            # (The server only terminates through the stop below, so waiting on this is waiting on it.)
            await registration.wait_refused()
    finally:
        # Runs on SIGTERM (the run task is cancelled): finish in-flight RPCs, remove the sockets.
        if watcher is not None:
            watcher.cancel()
        if transfers is not None:
            await transfers.stop()
        try:
            if reg_server is not None:
                await stop_unix_server(reg_server, 1.0)
        finally:
            await stop_unix_server(server, args.grace_period)


def main(argv: Sequence[str] | None = None) -> None:
    process.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
