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

from controller_runtime import goflags, process_threads
from controller_runtime.csi_lite import CSIClient
from controller_runtime.grpc_lite.client import Channel
from controller_runtime.grpc_lite.messages import Empty, PluginInfo
from controller_runtime.grpc_lite.status import RpcError
from controller_runtime.logs import get_logger
from controller_runtime.registration_lite import SERVICE, RegistrationServer
from controller_runtime.unix_sockets import SocketFile

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
    socket: SocketFile | None = None

    def check(self, timeout: float) -> str | None:
        """Healthy while the socket this process bound is in place and answers GetInfo with the
        driver's name, and kubelet has not refused the plugin."""
        if self.registration is None or self.socket is None:
            return "the registration socket is not served yet (waiting for the CSI driver)"
        if self.registration.refused.is_set():
            return f"kubelet refused the plugin registration: {self.registration.error}"
        if not self.socket.is_ours():
            return f"the registration socket {self.socket.path} does not exist"
        with Channel(self.socket.path) as channel:
            try:
                info = PluginInfo.decode(channel.call(f"{SERVICE}GetInfo", Empty().encode(), timeout))
            except RpcError as exc:
                return f"the registration socket does not answer GetInfo: {exc}"
        if info.name != self.registration.driver_name:
            return f"the registration socket serves driver {info.name!r}"
        return None


def run(args: argparse.Namespace, ctx: process_threads.Context) -> None:
    registrar = Registrar()
    if ctx.health is not None:
        ctx.health.add_liveness_check("registration", lambda: registrar.check(args.timeout))
    with CSIClient(args.csi_address, args.timeout) as csi:
        driver = csi.wait_driver_name(ctx.stopping)
    if ctx.stopping.is_set():
        return
    registrar.registration = RegistrationServer(driver, args.kubelet_registration_path)
    ctx.on_stop(registrar.registration.wake)
    registrar.socket = registrar.registration.serve(args.plugin_registration_path)
    log.info(
        "registration socket ready for kubelet",
        driver=driver,
        socket=registrar.socket.path,
        endpoint=args.kubelet_registration_path,
    )
    try:
        registrar.registration.wait_refused()
    finally:
        # Runs on SIGTERM as on a refusal: kubelet's plugin watcher sees the socket go and
        # deregisters the driver.
        registrar.registration.stop(1.0)


def main(argv: Sequence[str] | None = None) -> None:
    # On threads, without asyncio, grpcio and prometheus_client: a call now and then needs none of
    # them, and they would hold 25 MiB more than the process needs (issue 49).
    goflags.main_threaded(build_parser(), run, argv)


if __name__ == "__main__":
    main()
