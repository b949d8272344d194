"""`kubeloop-livenessprobe`: the kubernetes-csi livenessprobe sidecar as a process.

    kubeloop-livenessprobe --csi-address /csi/csi.sock --http-endpoint :9808 --probe-timeout 3s

Each GET /healthz calls the driver's Probe within --probe-timeout: 200 `ok` when the driver says it
is ready (or leaves `ready` unset), 500 with the error otherwise, so kubelet restarts a driver
container that hangs or reports itself broken. /metrics carries csi_sidecar_operations_seconds.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from controller_runtime import goflags, process_threads
from controller_runtime.csi_lite import CSIClient
from controller_runtime.grpc_lite.status import RpcError
from controller_runtime.health_threads import HealthServer
from controller_runtime.logs import get_logger

log = get_logger("livenessprobe")

NAME = "kubeloop-livenessprobe"


# The counterpart whose command line this one takes (tools/versions.env's LIVENESSPROBE_VERSION).
UPSTREAM = "livenessprobe v2.19.0"
HEALTH_PORT = "9808"


def build_parser() -> goflags.FlagSet:
    """Every flag of upstream's livenessprobe, parsed as Go's flag package does (docs/sidecar-flags.md)."""
    flags = goflags.node_sidecar(
        NAME,
        "Serves /healthz by calling a CSI driver's Probe (kubernetes-csi livenessprobe).",
        UPSTREAM,
    )
    Flag, S = goflags.Flag, goflags.Support
    flags.add(
        Flag("csi-address", "string", "/run/csi/socket", "the CSI driver's socket"),
        Flag("probe-timeout", "duration", "3s", "how long each Probe may take before /healthz fails"),
        Flag(
            "health-port",
            "string",
            HEALTH_PORT,
            "(deprecated) port serving /healthz on every IPv4 interface when --http-endpoint is empty; "
            "set to another value, not together with --http-endpoint",
        ),
        Flag(
            "http-endpoint",
            "string",
            "",
            "host:port serving /healthz and /metrics; an empty host (:9808) listens on every interface",
        ),
        Flag(
            "metrics-address",
            "string",
            "",
            "(deprecated) host:port serving /metrics apart; not together with --http-endpoint",
        ),
        Flag(
            "metrics-path",
            "string",
            "/metrics",
            "the HTTP path of the Prometheus metrics",
            S.REFUSED,
            "kubeloop serves its metrics at /metrics only",
        ),
    )
    flags.settle.append(settle)
    return flags


def settle(args: argparse.Namespace) -> None:
    """The address /healthz is served on, as upstream picks it."""
    if args.health_port != HEALTH_PORT and args.http_endpoint:
        raise goflags.FlagError("Only one of `--health-port` and `--http-endpoint` can be explicitly set")
    if args.metrics_address and args.http_endpoint:
        raise goflags.FlagError("Only one of `--metrics-address` and `--http-endpoint` can be explicitly set")
    if not args.http_endpoint:
        # Go listens on 0.0.0.0 as on an empty host: every interface, IPv6 as well.
        args.http_endpoint = f":{args.health_port}"


@dataclass
class LivenessProbe:
    address: str
    timeout: float
    driver_name: str = ""  # known once the driver has answered GetPluginInfo: labels the metrics

    def check(self) -> str | None:
        # A fresh connection per probe: a connection kept open to a driver that restarted would
        # fail the next probe, and kubelet would kill the driver again for it.
        with CSIClient(self.address, self.timeout, driver_name=self.driver_name) as csi:
            try:
                response = csi.probe()
            except RpcError as exc:
                log.warning("health check failed", driver=self.driver_name, error=str(exc))
                return str(exc)
        if not response.is_ready():
            log.warning("health check failed: the driver is not ready", driver=self.driver_name)
            return "driver responded but is not ready"
        log.debug("health check succeeded", driver=self.driver_name)
        return None


def run(args: argparse.Namespace, ctx: process_threads.Context) -> None:
    probe = LivenessProbe(args.csi_address, args.probe_timeout)
    if ctx.health is not None:
        ctx.health.add_liveness_check("csi", probe.check)
    # /healthz answers from the start (failing while the driver is away); the name only labels
    # the metrics, so it is learnt alongside, however long the driver takes.
    # The deprecated --metrics-address serves /metrics on a server of its own.
    metrics = HealthServer(args.metrics_address) if args.metrics_address else None
    if metrics is not None:
        metrics.start()
    try:
        with CSIClient(args.csi_address, args.probe_timeout) as csi:
            probe.driver_name = csi.wait_driver_name(ctx.stopping)
        ctx.stopping.wait()  # serve until SIGTERM
    finally:
        if metrics is not None:
            metrics.stop()


def main(argv: Sequence[str] | None = None) -> None:
    # On threads, without asyncio, grpcio and prometheus_client: a probe now and then needs none of
    # them, and they would hold 25 MiB more than the process needs (issue 49).
    goflags.main_threaded(build_parser(), run, argv)


if __name__ == "__main__":
    main()
