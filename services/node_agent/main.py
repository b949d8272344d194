"""`kubeloop-node-agent --node-name N`: kubelet's volume manager and node status for one node of
the local stack."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from controller_runtime import process
from controller_runtime.client import ApiClient
from controller_runtime.events import EventRecorder
from controller_runtime.logs import get_logger
from controller_runtime.metrics import REGISTRY

from .agent import NodeAgent, Options

log = get_logger("node-agent")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubeloop-node-agent",
        description="Registers a Node and mounts the volumes of the pods bound to it (kubelet's volume "
        "manager, without containers).",
    )
    parser.add_argument("--node-name", required=True, help="the Node this agent plays")
    parser.add_argument(
        "--root-dir",
        type=Path,
        default=Path("/var/lib/kubelet"),
        help="the node's kubelet root: plugins_registry/, plugins/, pods/ (default: /var/lib/kubelet)",
    )
    parser.add_argument(
        "--sync-period",
        type=process.duration,
        default=0.1,
        help="interval between volume reconcile passes (default: 100ms)",
    )
    parser.add_argument(
        "--node-status-update-frequency",
        type=process.duration,
        default=10.0,
        help="how often the node Lease is renewed (default: 10s)",
    )
    parser.add_argument(
        "--csi-timeout", type=process.duration, default=60.0, help="timeout of each CSI call (default: 60s)"
    )
    parser.add_argument(
        "--max-retry-interval",
        type=process.duration,
        default=122.0,
        help="longest wait before a failed mount is tried again (default: 2m2s)",
    )
    parser.add_argument(
        "--max-concurrent-volume-operations",
        type=int,
        default=8,
        help="volume operations (mount, unmount, unstage) run at once, each on a different volume, "
        "started in the order queued; 0 = no limit (default: 8)",
    )
    parser.add_argument(
        "--unmount-volumes-on-exit",
        action="store_true",
        help="on SIGTERM/SIGINT, unpublish and unstage every volume of this node before exiting, for "
        "a node that stops with its agent (the local stack, docker-compose); the pods keep their "
        "volumes and are mounted again when the agent starts. Off by default, as kubelet, whose "
        "restart leaves the volumes of running pods mounted",
    )
    parser.add_argument(
        "--volume-stats-agg-period",
        type=process.duration,
        default=60.0,
        help="how often each claim's volume is asked for its usage (NodeGetVolumeStats) for the "
        "kubelet_volume_stats_* metrics on /metrics; 0 disables them, as kubelet's flag (default: 1m)",
    )
    process.add_kube_flags(parser, qps=50.0, burst=100)
    process.add_http_flags(parser)
    process.add_logging_flags(parser)
    return parser


def metrics_url(endpoint: str | None) -> str:
    """The URL of /metrics on --http-endpoint as others on the machine reach it (an endpoint on every
    interface is reached on the node's address, 127.0.0.1)."""
    if not endpoint:
        return ""
    host, _, port = endpoint.rpartition(":")
    return f"http://{host if host not in ('', '0.0.0.0', '[::]') else '127.0.0.1'}:{port}/metrics"


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    client = await ApiClient.from_kubeconfig(
        args.kubeconfig or None,
        qps=args.kube_api_qps,
        burst=args.kube_api_burst,
        user_agent=f"kubeloop-node-agent/{args.node_name}",
    )
    recorder = EventRecorder(client, "kubelet", host=args.node_name)
    agent = NodeAgent(
        client,
        recorder,
        args.node_name,
        args.root_dir,
        Options(
            loop_period=args.sync_period,
            heartbeat=args.node_status_update_frequency,
            csi_timeout=args.csi_timeout,
            backoff_max=args.max_retry_interval,
            max_concurrent_operations=args.max_concurrent_volume_operations,
            unmount_on_exit=args.unmount_volumes_on_exit,
            volume_stats_period=args.volume_stats_agg_period,
            metrics_url=metrics_url(args.http_endpoint),
        ),
    )
    REGISTRY.register(agent.volume_stats)
    if ctx.health is not None:
        ctx.health.add_liveness_check("ping", lambda: None)
        ctx.health.add_readiness_check("volume-manager", lambda: None if agent.ready else "starting")
    try:
        await agent.run()
    finally:
        await recorder.close()
        await client.close()


def main(argv: Sequence[str] | None = None) -> None:
    process.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
