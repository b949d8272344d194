"""grpc_lite against real peers and hostile ones: its registration server under grpc-go's client
(the client kubelet's plugin watcher is, tests/support/grpc_go_client) and grpcio's, its client
against a Go CSI server (the e2e suite's mock driver) and grpcio servers; garbage, a peer that
closes mid-frame, a server that never answers, oversized messages. What the sidecars do with it
against kubeloop's own driver is tests/csi/test_node_sidecars.py."""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from controller_runtime.csi_client import CSIConnection
from controller_runtime.csi_lite import CSIClient
from controller_runtime.grpc_lite.aio import Channel as AioChannel
from controller_runtime.grpc_lite.client import Channel
from controller_runtime.grpc_lite.framing import MAX_MESSAGE
from controller_runtime.grpc_lite.messages import Empty, PluginInfo, RegistrationStatus
from controller_runtime.grpc_lite.status import Code, RpcError
from controller_runtime.registration_lite import SERVICE, RegistrationServer
from controller_runtime.toolchain import REPO_ROOT
from kubeloop_grpc.csi import csi_pb2
from kubeloop_grpc.pluginregistration import api_pb2, api_pb2_grpc
from tests.support.waits import eventually

pytestmark = pytest.mark.integration

GO_CLIENT = REPO_ROOT / "tests" / "support" / "grpc_go_client"
ENDPOINT = "/var/lib/kubelet/plugins/loop.csi.kubeloop.dev/csi.sock"


@pytest.fixture(scope="module")
def go_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """grpc-go's client, built from tests/support/grpc_go_client at the grpc version its go.mod pins."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    # Never skipped: without grpc-go's client the registration server's interop is untested.
    if not Path(go).exists():
        pytest.fail("no Go toolchain to build grpc-go's client with (make deps installs it)")
    out = tmp_path_factory.mktemp("go") / "grpc-go-client"
    subprocess.run([go, "build", "-o", str(out), "."], cwd=GO_CLIENT, check=True, timeout=600)
    return out


@pytest.fixture
def registration(tmp_path: Path) -> Iterator[RegistrationServer]:
    server = RegistrationServer("loop.csi.kubeloop.dev", ENDPOINT)
    server.serve(str(tmp_path / "registry"))
    try:
        yield server
    finally:
        server.stop(1.0)


def _socket(server: RegistrationServer) -> str:
    assert server.server is not None and server.server.socket is not None
    return server.server.socket.path


def go_call(client: Path, path: str, method: str, request: bytes = b"", timeout: str = "5s") -> str:
    out = subprocess.run(
        [str(client), f"unix://{path}", method, request.hex(), timeout],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return out.stdout.strip()


def test_grpc_gos_client_registers_the_plugin(go_client: Path, registration: RegistrationServer) -> None:
    path = _socket(registration)
    answer = go_call(go_client, path, f"{SERVICE}GetInfo")
    expected = api_pb2.PluginInfo(
        type="CSIPlugin", name="loop.csi.kubeloop.dev", endpoint=ENDPOINT, supported_versions=["1.0.0"]
    )
    assert answer == f"ok={expected.SerializeToString().hex()}"
    status = RegistrationStatus(False, "bad version: 9.9 ✗").encode()
    assert go_call(go_client, path, f"{SERVICE}NotifyRegistrationStatus", status) == "ok="
    assert registration.refused.is_set() and registration.error == "bad version: 9.9 ✗"


def test_grpc_go_reads_the_errors_as_grpc_go_servers_word_them(
    go_client: Path, registration: RegistrationServer
) -> None:
    path = _socket(registration)
    assert go_call(go_client, path, f"{SERVICE}Unregister") == (
        "code=Unimplemented message=unknown method Unregister for service pluginregistration.Registration"
    )
    assert (
        go_call(go_client, path, "/csi.v1.Identity/Probe")
        == "code=Unimplemented message=unknown service csi.v1.Identity"
    )
    assert go_call(go_client, path, f"{SERVICE}NotifyRegistrationStatus", b"\xff\xff") == (
        "code=Internal message=grpc: error unmarshalling request: truncated varint"
    )
    assert not registration.refused.is_set()


def test_grpcios_client_is_served_too(registration: RegistrationServer) -> None:
    with grpc.insecure_channel(f"unix://{_socket(registration)}") as channel:
        stub = api_pb2_grpc.RegistrationStub(channel)
        info = stub.GetInfo(api_pb2.InfoRequest(), timeout=5)
        assert (info.name, info.endpoint, list(info.supported_versions)) == (
            "loop.csi.kubeloop.dev",
            ENDPOINT,
            ["1.0.0"],
        )
        stub.NotifyRegistrationStatus(api_pb2.RegistrationStatus(plugin_registered=True), timeout=5)
        assert registration.registered
        too_big = channel.unary_unary(f"{SERVICE}GetInfo")
        with pytest.raises(grpc.RpcError) as raised:
            too_big(b"\x0a" + b"\xff\xff\xff\x02" + bytes(MAX_MESSAGE), timeout=10)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The connection is still good after the refusal.
        assert stub.GetInfo(api_pb2.InfoRequest(), timeout=5).name == "loop.csi.kubeloop.dev"


def _connections(server: RegistrationServer) -> int:
    assert server.server is not None
    return server.server.connections()


@pytest.mark.parametrize(
    "sent",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        os.urandom(4096),
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x10\x04",  # a SETTINGS frame cut short
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
        + b"\x00\x40\x00\x01\x04",
    ],
    ids=["http1", "random", "cut-mid-frame", "cut-mid-headers"],
)
def test_garbage_and_hang_ups_cost_a_connection_only(registration: RegistrationServer, sent: bytes) -> None:
    threads = threading.active_count()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(_socket(registration))
        sock.sendall(sent)
        sock.shutdown(socket.SHUT_WR)  # the peer goes away, possibly in the middle of a frame
        while sock.recv(65536):
            pass  # the server's SETTINGS, perhaps a GOAWAY, then its close
    eventually("the connection's thread ends", lambda: _connections(registration) == 0, 5)
    eventually("no thread is left", lambda: threading.active_count() <= threads, 5)
    with Channel(_socket(registration)) as channel:
        info = PluginInfo.decode(channel.call(f"{SERVICE}GetInfo", b"", 5))
    assert info.name == "loop.csi.kubeloop.dev"


def test_stop_ends_silent_connections_and_leaves_no_thread(tmp_path: Path) -> None:
    before = threading.active_count()
    server = RegistrationServer("d", ENDPOINT)
    path = server.serve(str(tmp_path)).path
    silent = [socket.socket(socket.AF_UNIX) for _ in range(3)]
    for sock in silent:
        sock.connect(path)
    eventually(
        "three connections served", lambda: server.server is not None and server.server.connections() == 3, 5
    )
    started = time.monotonic()
    server.stop(2.0)
    assert time.monotonic() - started < 2.0
    assert threading.active_count() == before and not os.path.exists(path)
    for sock in silent:
        sock.close()


# The client side: grpc_lite's Channel against servers.


@pytest.fixture
def go_csi_driver(tmp_path: Path) -> Iterator[str]:
    """The e2e suite's mock CSI driver (tools/kind-e2e/csi-mock-driver), a grpc-go server."""
    found = sorted(glob.glob(os.path.expanduser("~/.cache/kubeloop/bin/csi-mock-driver-*/csi-mock-driver")))
    if not found:
        pytest.fail("the Go CSI mock driver is not built: run `bash tools/build-binaries.sh csi-mock`")
    sock = tmp_path / "csi.sock"
    proc = subprocess.Popen(
        [
            found[-1],
            "-endpoint",
            f"unix://{sock}",
            "-drivername",
            "mock.csi.example",
            "-statedir",
            str(tmp_path / "s"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        eventually("the mock driver's socket", sock.exists, 20)
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_csi_calls_against_a_grpc_go_driver(go_csi_driver: str) -> None:
    stopping = threading.Event()
    with CSIClient(go_csi_driver, timeout=5) as csi:
        assert csi.wait_driver_name(stopping) == "mock.csi.example"
        assert csi.probe().is_ready()
        assert csi.plugin_info().name == "mock.csi.example"  # again, on the same connection


def _grpcio_server(
    path: str, handlers: dict[str, Callable[[bytes, grpc.ServicerContext], bytes]]
) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    methods = {name: grpc.unary_unary_rpc_method_handler(h) for name, h in handlers.items()}
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("csi.v1.Identity", methods)])
    server.add_insecure_port(f"unix://{path}")
    server.start()
    return server


def test_the_client_reads_grpcios_statuses_and_limits(tmp_path: Path) -> None:
    release = threading.Event()

    def fails(_req: bytes, ctx: grpc.ServicerContext) -> bytes:
        ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "volume 100% busy: ümlaut\nsecond line")
        raise AssertionError

    def huge(_req: bytes, _ctx: grpc.ServicerContext) -> bytes:
        return b"\x0a" + bytes(MAX_MESSAGE + 10)

    def hangs(_req: bytes, _ctx: grpc.ServicerContext) -> bytes:
        release.wait(10)
        return b""

    path = str(tmp_path / "s.sock")
    server = _grpcio_server(path, {"Fails": fails, "Huge": huge, "Hangs": hangs, "Probe": lambda _r, _c: b""})
    try:
        with Channel(path) as channel:
            with pytest.raises(RpcError) as raised:
                channel.call("/csi.v1.Identity/Fails", b"", 5)
            assert (raised.value.code, raised.value.details) == (
                Code.FAILED_PRECONDITION,
                "volume 100% busy: ümlaut\nsecond line",
            )
            with pytest.raises(RpcError) as raised:
                channel.call("/csi.v1.Identity/Huge", b"", 10)
            assert raised.value.code is Code.RESOURCE_EXHAUSTED
            assert (
                raised.value.details
                == f"Received message larger than max ({MAX_MESSAGE + 11} vs. {MAX_MESSAGE})"
            )
            started = time.monotonic()
            with pytest.raises(RpcError) as raised:
                channel.call("/csi.v1.Identity/Hangs", b"", 0.3)
            assert (raised.value.code, str(raised.value)) == (
                Code.DEADLINE_EXCEEDED,
                "rpc error: code = DeadlineExceeded desc = Deadline Exceeded",
            )
            assert time.monotonic() - started < 2
            release.set()
            with pytest.raises(RpcError) as raised:
                channel.call("/csi.v1.Identity/Nope", b"", 5)
            assert raised.value.code is Code.UNIMPLEMENTED
            assert Empty.decode(channel.call("/csi.v1.Identity/Probe", b"", 5)) == Empty()
    finally:
        release.set()
        server.stop(None)


def _raw_server(path: str, behave: Callable[[socket.socket], object]) -> threading.Thread:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                behave(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_server_that_never_answers_ends_at_the_deadline(tmp_path: Path) -> None:
    done = threading.Event()
    path = str(tmp_path / "mute.sock")
    thread = _raw_server(path, lambda conn: done.wait(10))
    started = time.monotonic()
    with pytest.raises(RpcError) as raised, Channel(path) as channel:
        channel.call("/csi.v1.Identity/Probe", b"", 0.3)
    assert raised.value.code is Code.DEADLINE_EXCEEDED and time.monotonic() - started < 2
    done.set()
    thread.join(5)


def test_a_server_that_hangs_up_mid_frame_is_unavailable(tmp_path: Path) -> None:
    path = str(tmp_path / "cut.sock")

    def cut(conn: socket.socket) -> None:
        conn.recv(65536)
        conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00")  # the first bytes of a SETTINGS frame

    thread = _raw_server(path, cut)
    with pytest.raises(RpcError) as raised, Channel(path) as channel:
        channel.call("/csi.v1.Identity/Probe", b"", 5)
    assert (raised.value.code, raised.value.details) == (Code.UNAVAILABLE, "Socket closed")
    thread.join(5)


def test_a_server_that_is_not_grpc_is_unavailable(tmp_path: Path) -> None:
    path = str(tmp_path / "http.sock")
    thread = _raw_server(path, lambda conn: conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 20))
    with pytest.raises(RpcError) as raised, Channel(path) as channel:
        channel.call("/csi.v1.Identity/Probe", b"", 5)
    assert raised.value.code is Code.UNAVAILABLE
    thread.join(5)


def test_no_socket_reads_as_grpcio_words_it(tmp_path: Path) -> None:
    path = tmp_path / "absent.sock"
    with pytest.raises(RpcError) as raised, Channel(f"unix://{path}") as channel:
        channel.call("/csi.v1.Identity/Probe", b"", 5)
    assert str(raised.value) == (
        "rpc error: code = Unavailable desc = failed to connect to all addresses; last error: "
        f"FAILED_PRECONDITION: unix:{path}: connect failed: addr: unix:{path} "
        "error: No such file or directory"
    )


# The asyncio channel (grpc_lite.aio), which the sidecars' CSI connection calls drivers through.


async def test_the_aio_channel_against_a_grpc_go_driver(go_csi_driver: str) -> None:
    """grpc-go codes its answers' headers with Huffman strings and a dynamic table: many calls in
    flight at once on one connection, then a volume created and deleted."""
    conn = await CSIConnection.connect(go_csi_driver, timeout=5, wait=20)
    try:
        assert conn.driver_name == "mock.csi.example"
        infos = await asyncio.gather(
            *(conn.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=5) for _ in range(200))
        )
        assert {i.name for i in infos} == {"mock.csi.example"}
        created = await conn.controller.CreateVolume(
            csi_pb2.CreateVolumeRequest(
                name="aio-1",
                capacity_range=csi_pb2.CapacityRange(required_bytes=1 << 20),
                volume_capabilities=[
                    csi_pb2.VolumeCapability(
                        mount=csi_pb2.VolumeCapability.MountVolume(),
                        access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1),
                    )
                ],
            ),
            timeout=5,
        )
        assert created.volume.volume_id
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await conn.controller.CreateVolume(csi_pb2.CreateVolumeRequest(), timeout=5)
        assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT and raised.value.details()
        await conn.controller.DeleteVolume(
            csi_pb2.DeleteVolumeRequest(volume_id=created.volume.volume_id), timeout=5
        )
    finally:
        await conn.close()


async def test_the_aio_channel_reads_grpcios_statuses_limits_deadlines_and_cancels(tmp_path: Path) -> None:
    release = threading.Event()

    def fails(_req: bytes, ctx: grpc.ServicerContext) -> bytes:
        ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "volume 100% busy: ümlaut\nsecond line")
        raise AssertionError

    def hangs(_req: bytes, _ctx: grpc.ServicerContext) -> bytes:
        release.wait(10)
        return b""

    path = str(tmp_path / "s.sock")
    server = _grpcio_server(
        path,
        {
            "Fails": fails,
            "Huge": lambda _r, _c: b"\x0a" + bytes(MAX_MESSAGE + 10),
            "Big": lambda _r, _c: b"\x0a" + bytes(3 << 20),  # under the limit, over any default window
            "Echo": lambda r, _c: r,
            "Hangs": hangs,
        },
    )
    channel = AioChannel(path)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await channel.call("/csi.v1.Identity/Fails", b"", 5)
        assert (raised.value.code(), raised.value.details()) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "volume 100% busy: ümlaut\nsecond line",
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await channel.call("/csi.v1.Identity/Huge", b"", 10)
        assert (raised.value.code(), raised.value.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"Received message larger than max ({MAX_MESSAGE + 11} vs. {MAX_MESSAGE})",
        )
        assert len(await channel.call("/csi.v1.Identity/Big", b"", 10)) == (3 << 20) + 1
        # A request larger than HTTP/2's first window waits for the server's WINDOW_UPDATEs.
        request = bytes(range(256)) * 1024
        answers = await asyncio.gather(
            *(channel.call("/csi.v1.Identity/Echo", request, 10) for _ in range(4))
        )
        assert answers == [request] * 4
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await channel.call("/csi.v1.Identity/Hangs", b"", 0.3)
        assert (raised.value.code(), raised.value.details()) == (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "Deadline Exceeded",
        )
        assert time.monotonic() - started < 2
        hung = asyncio.ensure_future(channel.call("/csi.v1.Identity/Hangs", b"", 10))
        await asyncio.sleep(0.1)
        hung.cancel()
        with pytest.raises(asyncio.CancelledError):
            await hung
        release.set()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await channel.call("/csi.v1.Identity/Nope", b"", 5)
        assert raised.value.code() is grpc.StatusCode.UNIMPLEMENTED
        assert await channel.call("/csi.v1.Identity/Echo", b"same connection", 5) == b"same connection"
    finally:
        release.set()
        await channel.close()
        server.stop(None)


async def test_the_aio_channel_against_hostile_and_absent_servers(tmp_path: Path) -> None:
    absent = tmp_path / "absent.sock"
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await AioChannel(f"unix://{absent}").call("/csi.v1.Identity/Probe", b"", 5)
    assert (raised.value.code(), raised.value.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        f"failed to connect to all addresses; last error: FAILED_PRECONDITION: unix:{absent}: "
        f"connect failed: addr: unix:{absent} error: No such file or directory",
    )
    done = threading.Event()
    mute = str(tmp_path / "mute.sock")
    thread = _raw_server(mute, lambda conn: done.wait(10))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await AioChannel(mute).call("/csi.v1.Identity/Probe", b"", 0.3)
    assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    done.set()
    thread.join(5)

    def cut(conn: socket.socket) -> None:
        conn.recv(65536)
        conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00")  # the first bytes of a SETTINGS frame

    for behave, details in (
        (cut, "Socket closed"),
        (lambda conn: conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 20), None),
    ):
        path = str(tmp_path / "hostile.sock")
        thread = _raw_server(path, behave)
        channel = AioChannel(path)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await channel.call("/csi.v1.Identity/Probe", b"", 5)
        assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
        assert details is None or raised.value.details().startswith(details)
        thread.join(5)
        os.unlink(path)
        # The broken connection is not reused: the next call connects anew, to a real server.
        server = _grpcio_server(path, {"Probe": lambda _r, _c: b""})
        try:
            assert await channel.call("/csi.v1.Identity/Probe", b"", 5) == b""
        finally:
            await channel.close()
            server.stop(None)
