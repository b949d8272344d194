"""`kubeloop-livenessprobe`: the kubernetes-csi livenessprobe sidecar as a process.

    kubeloop-livenessprobe --csi-address /csi/csi.sock --http-endpoint :9808 --probe-timeout 3s

Each GET /healthz calls the driver's Probe within --probe-timeout: 200 `ok` when the driver says it
is ready (or leaves `ready` unset), 500 with the error otherwise, so kubelet restarts a driver
container that hangs or reports itself broken. /metrics carries csi_sidecar_operations_seconds.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from controller_runtime import goflags, process
from controller_runtime.csi_client import CSIConnection, error_text, probe_ready
from controller_runtime.health import HealthServer
from controller_runtime.logs import get_logger
from kubeloop_grpc.csi import csi_pb2

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

    async def check(self) -> str | None:
        # A fresh connection per probe: a channel kept open would, after the driver restarted,
        # fail calls until its reconnect backoff (up to minutes) ends, and kubelet would kill the
        # driver again for it.
        conn = CSIConnection.open(self.address, timeout=self.timeout)
        conn.driver_name = self.driver_name
        try:
            response = await conn.identity.Probe(csi_pb2.ProbeRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            log.warning("health check failed", driver=self.driver_name, error=error_text(exc))
            return error_text(exc)
        finally:
            await conn.close()
        if not probe_ready(response):
            log.warning("health check failed: the driver is not ready", driver=self.driver_name)
            return "driver responded but is not ready"
        log.debug("health check succeeded", driver=self.driver_name)
        return None


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    probe = LivenessProbe(args.csi_address, args.probe_timeout)
    if ctx.health is not None:
        ctx.health.add_liveness_check("csi", probe.check)
    # /healthz answers from the start (failing while the driver is away); the name only labels
    # the metrics, so it is learnt alongside, however long the driver takes.
    # The deprecated --metrics-address serves /metrics on a server of its own.
    metrics = HealthServer(args.metrics_address) if args.metrics_address else None
    if metrics is not None:
        await metrics.start()
    try:
        csi = CSIConnection.open(args.csi_address, timeout=args.probe_timeout)
        try:
            probe.driver_name = await csi.wait_driver_name()
        finally:
            await csi.close()
        await asyncio.get_running_loop().create_future()  # serve until SIGTERM
    finally:
        if metrics is not None:
            await metrics.stop()


def main(argv: Sequence[str] | None = None) -> None:
    # asyncio's own loop: a call now and then gains nothing from uvloop, which costs 2 MiB (issue 49).
    goflags.main(build_parser(), run, argv, fast_loop=False)


if __name__ == "__main__":
    main()
