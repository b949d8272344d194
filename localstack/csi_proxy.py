"""The CSI socket proxy the Kubernetes e2e suite's "CSI Mock" specs deploy, so those specs can run
kubeloop's sidecars against the mock driver the suite embeds in e2e.test.

The suite's mock driver runs in the e2e.test process, not in the cluster. Its pod in the cluster
(storage-csi/mock/csi-mock-proxy.yaml) runs csi-driver-host-path's image with `-proxy-endpoint=
tcp://:9000`: a process that listens on the driver's unix socket, where the sidecars and kubelet
connect, and on a TCP port, where e2e.test keeps a few connections open through the API server's
port-forwarding. Each client of the unix socket is paired with one waiting TCP connection and the
bytes of the two are copied both ways (socat's `UNIX-LISTEN:...,fork TCP-LISTEN:9000,reuseport`,
which the suite's proxy code also names), so the client speaks gRPC with e2e.test's mock.

That image cannot be built here (the Go module proxy does not serve csi-driver-host-path), so the
suite's registry map points its name at this process instead (localstack/csi_mock.py), with the
same command line: the flags of hostpathplugin the proxy manifest passes, in Go's syntax. The TCP
port stays open from the start, so e2e.test's connections queue in the kernel before a client
comes, which is what lets the registrar's short gRPC timeouts hold."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from collections.abc import Sequence

from controller_runtime import goflags, process
from controller_runtime.goflags import Flag, FlagSet, Support, Syntax
from controller_runtime.logs import get_logger

log = get_logger("csi-proxy")
CHUNK = 64 * 1024


def flags() -> FlagSet:
    fs = FlagSet(
        "kubeloop-csi-proxy",
        "Pairs each client of a CSI unix socket with one connection waiting on a TCP port and copies "
        "bytes both ways: the proxy mode of csi-driver-host-path's hostpathplugin, which the e2e "
        "suite's CSI Mock specs deploy in front of the mock driver they embed in e2e.test.",
        Syntax.GO,
        "hostpathplugin v1.17.1 (its -proxy-endpoint mode)",
    )
    fs.add(
        *goflags.logging_flags(Syntax.GO),
        Flag("endpoint", "string", "unix://tmp/csi.sock", "the CSI socket to serve: unix://PATH or a path"),
        Flag("proxy-endpoint", "string", "", "tcp://[HOST]:PORT where the connections to pair wait"),
        Flag(
            "nodeid", "string", "", "the driver's node id", Support.IGNORED, "the proxy answers no CSI call"
        ),
        Flag(
            "drivername",
            "string",
            "hostpath.csi.k8s.io",
            "the driver's name",
            Support.IGNORED,
            "the proxy answers no CSI call",
        ),
    )
    fs.settle.append(goflags.settle_logging)
    fs.settle.append(_settle)
    return fs


def _settle(args: argparse.Namespace) -> None:
    if not args.proxy_endpoint:
        raise goflags.FlagError("-proxy-endpoint is required: this process is only the proxy")
    args.socket = unix_path(args.endpoint)
    args.host, args.port = tcp_address(args.proxy_endpoint)


def unix_path(endpoint: str) -> str:
    for prefix in ("unix://", "unix:"):
        if endpoint.startswith(prefix):
            endpoint = endpoint[len(prefix) :]
            break
    if not endpoint.startswith("/"):
        endpoint = "/" + endpoint  # hostpath's default unix://tmp/csi.sock means /tmp/csi.sock
    return endpoint


def tcp_address(endpoint: str) -> tuple[str, int]:
    if not endpoint.startswith("tcp://"):
        raise goflags.FlagError(f"-proxy-endpoint {endpoint!r}: only tcp://[HOST]:PORT is supported")
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise goflags.FlagError(f"-proxy-endpoint {endpoint!r}: the port must be a number 1-65535")
    return host, int(port)


class Proxy:
    """The pairing: TCP connections wait in arrival order; each unix client takes the oldest."""

    def __init__(self) -> None:
        self.waiting: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        self.pairs = 0

    async def on_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.waiting.put((reader, writer))

    async def on_unix(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        far_reader, far_writer = await self.waiting.get()
        self.pairs += 1
        log.debug("paired", pair=self.pairs, waiting=self.waiting.qsize())
        await asyncio.gather(_copy(reader, far_writer), _copy(far_reader, writer))
        for w in (writer, far_writer):
            w.close()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copies until end of stream, then half-closes the far side, as socat does."""
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    proxy = Proxy()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)  # hostpath removes a stale socket the same way
    os.makedirs(os.path.dirname(args.socket), exist_ok=True)
    tcp = await asyncio.start_server(proxy.on_tcp, args.host or None, args.port, reuse_port=True)
    unix = await asyncio.start_unix_server(proxy.on_unix, args.socket)
    os.chmod(args.socket, 0o600)
    log.info("proxying", socket=args.socket, tcp=f"{args.host}:{args.port}")
    try:
        await asyncio.get_running_loop().create_future()
    finally:
        unix.close()
        tcp.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(args.socket)


def main(argv: Sequence[str] | None = None) -> None:
    goflags.main(flags(), run, argv)


if __name__ == "__main__":
    main()
