"""`kubeloop-node-driver-registrar`: the kubernetes-csi node-driver-registrar sidecar as a process.

    kubeloop-node-driver-registrar --csi-address /csi/csi.sock \\
        --kubelet-registration-path /var/lib/kubelet/plugins/loop.csi.kubeloop.dev/csi.sock \\
        --plugin-registration-path /registration --http-endpoint :9809

It learns the driver's name from GetPluginInfo on --csi-address, then serves kubelet's
plugin-registration API on <plugin-registration-path>/<driver>-reg.sock, telling kubelet to reach
the driver at --kubelet-registration-path. When kubelet reports that registration failed it exits
1, so the container is restarted and registers again; SIGTERM removes the socket and exits 0.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from controller_runtime import goflags, process
from controller_runtime.csi_client import CSIConnection, error_text
from controller_runtime.logs import get_logger
from controller_runtime.plugin_registration import RegistrationServer
from controller_runtime.unix_grpc import UnixServer, stop_unix_server
from kubeloop_grpc.pluginregistration import api_pb2, api_pb2_grpc

log = get_logger("node-driver-registrar")

NAME = "kubeloop-node-driver-registrar"


# The counterpart whose command line this one takes (tools/versions.env's NODE_DRIVER_REGISTRAR_VERSION).
UPSTREAM = "node-driver-registrar v2.17.0"
PROBE_MODE = "kubelet-registration-probe"


def build_parser() -> goflags.FlagSet:
    """Every flag of upstream's csi-node-driver-registrar, parsed as Go's flag package does
    (docs/sidecar-flags.md)."""
    flags = goflags.node_sidecar(
        NAME,
        "Registers a CSI driver with kubelet's plugin watcher (kubernetes-csi node-driver-registrar).",
        UPSTREAM,
    )
    Flag = goflags.Flag
    flags.add(
        goflags.PPROF,
        Flag("version", "bool", "false", "print the version and exit"),
        Flag("csi-address", "string", "/run/csi/socket", "the CSI driver's socket in this container"),
        Flag("timeout", "duration", "1s", "timeout of each GetPluginInfo and health-check call"),
        Flag(
            "kubelet-registration-path",
            "string",
            "",
            "the CSI driver's socket as kubelet on the host sees it, handed to kubelet by GetInfo (required)",
        ),
        Flag(
            "plugin-registration-path",
            "string",
            "/registration",
            "kubelet's plugin registration directory as this container sees it; the socket "
            "<driver>-reg.sock is served there",
        ),
        Flag(
            "http-endpoint",
            "string",
            "",
            "host:port serving /healthz (the registration socket is in place and kubelet took the "
            "plugin), /readyz and /metrics; an empty host (:9809) listens on every interface",
        ),
        Flag(
            "health-port",
            "int",
            "0",
            "(deprecated) a port above 0 means --http-endpoint :PORT; not together with --http-endpoint",
        ),
        Flag(
            "mode",
            "string",
            "",
            "(deprecated) kubelet-registration-probe exits 0 at once, registering nothing",
        ),
        Flag(
            "connection-timeout",
            "duration",
            "0s",
            "(deprecated) no effect; a value other than 0 is logged as such",
        ),
    )
    flags.settle += [goflags.settle_version(NAME), settle]
    return flags


def settle(args: argparse.Namespace) -> None:
    """What upstream checks after parsing, in its order."""
    if not args.kubelet_registration_path:
        raise goflags.FlagError("kubelet-registration-path is a required parameter")
    if args.mode == PROBE_MODE:
        raise SystemExit(0)  # upstream's probe mode, no longer needed, succeeds as a no-op
    if args.health_port > 0 and args.http_endpoint:
        raise goflags.FlagError("Only one of `--health-port` and `--http-endpoint` can be set")
    if args.health_port > 0:
        args.http_endpoint = f":{args.health_port}"
    if args.connection_timeout:
        args.flag_warnings.append("--connection-timeout is deprecated and will have no effect")


@dataclass
class Registrar:
    """The registration socket being served, and the liveness node-driver-registrar reports on it."""

    registration: RegistrationServer | None = None
    server: UnixServer | None = None

    async def check(self, timeout: float) -> str | None:
        """Healthy while the socket this process bound is in place and answers GetInfo with the
        driver's name, and kubelet has not refused the plugin."""
        if self.registration is None or self.server is None:
            return "the registration socket is not served yet (waiting for the CSI driver)"
        if self.registration.refused.is_set():
            return f"kubelet refused the plugin registration: {self.registration.error}"
        if not self.server.is_ours():
            return f"the registration socket {self.server.path} does not exist"
        async with grpc.aio.insecure_channel(f"unix:{self.server.path}") as channel:
            try:
                info = await api_pb2_grpc.RegistrationStub(channel).GetInfo(
                    api_pb2.InfoRequest(), timeout=timeout
                )
            except grpc.aio.AioRpcError as exc:
                return f"the registration socket does not answer GetInfo: {error_text(exc)}"
        if info.name != self.registration.driver_name:
            return f"the registration socket serves driver {info.name!r}"
        return None


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    registrar = Registrar()
    if ctx.health is not None:
        ctx.health.add_liveness_check("registration", lambda: registrar.check(args.timeout))
    csi = CSIConnection.open(args.csi_address, timeout=args.timeout)
    try:
        driver = await csi.wait_driver_name()
    finally:
        await csi.close()
    registrar.registration = RegistrationServer(driver, args.kubelet_registration_path)
    registrar.server = await registrar.registration.serve(args.plugin_registration_path)
    log.info(
        "registration socket ready for kubelet",
        driver=driver,
        socket=registrar.server.path,
        endpoint=args.kubelet_registration_path,
    )
    try:
        await registrar.registration.wait_refused()
    finally:
        # Runs on SIGTERM as on a refusal: kubelet's plugin watcher sees the socket go and
        # deregisters the driver.
        await stop_unix_server(registrar.server, 1.0)


def main(argv: Sequence[str] | None = None) -> None:
    # asyncio's own loop: a call now and then gains nothing from uvloop, which costs 2 MiB (issue 49).
    goflags.main(build_parser(), run, argv, fast_loop=False)


if __name__ == "__main__":
    main()
