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

from controller_runtime import process
from controller_runtime.csi_client import CSIConnection, error_text, probe_ready
from controller_runtime.logs import get_logger
from kubeloop_grpc.csi import csi_pb2

log = get_logger("livenessprobe")

NAME = "kubeloop-livenessprobe"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=NAME,
        description="Serves /healthz by calling a CSI driver's Probe (kubernetes-csi livenessprobe).",
    )
    process.add_csi_flags(parser, timeout=None)
    parser.add_argument(
        "--probe-timeout",
        type=process.duration,
        default=1.0,
        help="how long each Probe may take before /healthz fails (default: 1s)",
    )
    process.add_http_flags(parser, default=":9808", health_port=True)
    process.add_logging_flags(parser)
    return parser


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
    csi = CSIConnection.open(args.csi_address, timeout=args.probe_timeout)
    try:
        probe.driver_name = await csi.wait_driver_name()
    finally:
        await csi.close()
    await asyncio.get_running_loop().create_future()  # serve until SIGTERM


def main(argv: Sequence[str] | None = None) -> None:
    process.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
