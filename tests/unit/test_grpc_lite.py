"""grpc_lite's messages against the generated stubs byte for byte, its status wording, and the
threaded HTTP endpoint against the asyncio one: what node-driver-registrar and livenessprobe serve
without grpcio, asyncio and prometheus_client (their metrics: tests/unit/test_metrics.py)."""

from __future__ import annotations

import re
import socket

import pytest
from hpack import Encoder

from controller_runtime import health, health_threads
from controller_runtime.grpc_lite import aio, framing, messages, wire
from controller_runtime.grpc_lite.status import Code, RpcError, decode_message, encode_message, go_name
from controller_runtime.metrics import Registry
from kubeloop_grpc.csi import csi_pb2
from kubeloop_grpc.pluginregistration import api_pb2
from tests.support.imports import imported_packages

# A field of every wire type no message here has: a newer peer's additions, to be skipped.
UNKNOWN = (
    wire.tag(99, wire.VARINT)
    + wire.varint(300)
    + wire.length_delimited(100, b"new")
    + wire.tag(101, wire.I32)
    + b"\x01\x02\x03\x04"
    + wire.tag(102, wire.I64)
    + bytes(8)
)

CASES = [
    (messages.Empty(), api_pb2.InfoRequest()),
    (messages.Empty(), csi_pb2.ProbeRequest()),
    (
        messages.PluginInfo(
            "CSIPlugin", "loop.csi.kubeloop.dev", "/var/lib/kubelet/plugins/x/csi.sock", ("1.0.0",)
        ),
        api_pb2.PluginInfo(
            type="CSIPlugin",
            name="loop.csi.kubeloop.dev",
            endpoint="/var/lib/kubelet/plugins/x/csi.sock",
            supported_versions=["1.0.0"],
        ),
    ),
    (
        messages.PluginInfo("", "ä-driver", "", ("1.0.0", "", "2.0.0")),
        api_pb2.PluginInfo(name="ä-driver", supported_versions=["1.0.0", "", "2.0.0"]),
    ),
    (messages.RegistrationStatus(True, ""), api_pb2.RegistrationStatus(plugin_registered=True)),
    (
        messages.RegistrationStatus(False, "unsupported version"),
        api_pb2.RegistrationStatus(plugin_registered=False, error="unsupported version"),
    ),
    (messages.ProbeResponse(None), csi_pb2.ProbeResponse()),
    (messages.ProbeResponse(True), csi_pb2.ProbeResponse(ready={"value": True})),
    (messages.ProbeResponse(False), csi_pb2.ProbeResponse(ready={})),
    (
        messages.GetPluginInfoResponse("loop.csi.kubeloop.dev", "v0.1.0", {"url": "https://x"}),
        csi_pb2.GetPluginInfoResponse(
            name="loop.csi.kubeloop.dev", vendor_version="v0.1.0", manifest={"url": "https://x"}
        ),
    ),
    (
        messages.GetPluginInfoResponse("d", "", {"": ""}),  # a map entry's empty key and value are written
        csi_pb2.GetPluginInfoResponse(name="d", manifest={"": ""}),
    ),
]


@pytest.mark.parametrize(("ours", "stub"), CASES)
def test_messages_are_written_as_the_generated_stubs_write_them(ours: messages.Empty, stub: object) -> None:
    assert ours.encode() == stub.SerializeToString()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("ours", "stub"), CASES)
def test_messages_read_what_the_stubs_write_skipping_unknown_fields(
    ours: messages.Empty, stub: object
) -> None:
    data = stub.SerializeToString()  # type: ignore[attr-defined]
    assert type(ours).decode(data) == ours
    assert type(ours).decode(UNKNOWN + data + UNKNOWN) == ours


def test_a_manifest_of_many_entries_reads_back_through_the_stubs() -> None:
    manifest = {"url": "https://x", "": "empty key", "empty value": "", "ü": "ß"}
    ours = messages.GetPluginInfoResponse("d", "1", manifest)
    stub = csi_pb2.GetPluginInfoResponse()
    stub.ParseFromString(ours.encode())
    assert (stub.name, stub.vendor_version, dict(stub.manifest)) == ("d", "1", manifest)
    theirs = csi_pb2.GetPluginInfoResponse(
        name="d", vendor_version="1", manifest=manifest
    ).SerializeToString()
    assert messages.GetPluginInfoResponse.decode(theirs) == ours


def test_probe_readiness_reads_as_csi_client_reads_it() -> None:
    assert messages.ProbeResponse(None).is_ready() and messages.ProbeResponse(True).is_ready()
    assert not messages.ProbeResponse(False).is_ready()


@pytest.mark.parametrize(
    "data",
    [b"\x0a\x05ab", b"\x08", b"\x80" * 11, b"\x0b", b"\x00\x01", b"\x0a\x02\xff\xfe"],
    ids=["truncated-string", "truncated-varint", "long-varint", "group", "field-0", "bad-utf8"],
)
def test_what_is_not_a_message_is_refused(data: bytes) -> None:
    with pytest.raises(wire.DecodeError):
        messages.PluginInfo.decode(data)


def test_status_is_worded_as_grpc_go_prints_it() -> None:
    assert [go_name(c.name) for c in (Code.OK, Code.CANCELLED, Code.DEADLINE_EXCEEDED)] == [
        "OK",
        "Canceled",
        "DeadlineExceeded",
    ]
    assert (
        str(RpcError(Code.NOT_FOUND, "no such volume")) == "rpc error: code = NotFound desc = no such volume"
    )
    for text in ("plain", "100% sure", "ünïcode ✓", "line\nbreak"):
        encoded = encode_message(text)
        assert encoded.isascii() and all(0x20 <= ord(c) < 0x7F for c in encoded)
        assert decode_message(encoded) == text
    assert decode_message("b%C3%A4d%25") == "bäd%"


REQUESTS = [
    b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /readyz?verbose HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /livez HTTP/1.0\r\n\r\n",
    b"GET /debug/queues HTTP/1.1\r\nConnection: close\r\n\r\n",
    b"POST /healthz HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
    b"GET /nope HTTP/1.1\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"garbage\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nContent-Length: x\r\n\r\n",
]


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)  # the server answers, then sees the end and closes
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return re.sub(rb"Date: [^\r]*", b"Date: D", answer)


async def test_the_threaded_endpoint_answers_as_the_asyncio_one() -> None:
    reasons = {"csi": "rpc error: code = Unavailable desc = gone"}
    threaded = health_threads.HealthServer("127.0.0.1:0", registry=Registry([]))
    threaded.add_liveness_check("csi", lambda: reasons["csi"])
    asynchronous = health.HealthServer("127.0.0.1:0", registry=Registry([]))
    asynchronous.add_liveness_check("csi", lambda: reasons["csi"])
    threaded.start()
    await asynchronous.start()
    try:
        for request in REQUESTS:
            ours = _exchange(threaded.port, request)
            loop = __import__("asyncio").get_running_loop()
            theirs = await loop.run_in_executor(None, _exchange, asynchronous.port, request)
            assert ours == theirs, request
        # Keep-alive: two requests on one connection, answered in order.
        both = _exchange(threaded.port, REQUESTS[0] + REQUESTS[3])
        assert both.count(b"HTTP/1.1 500") == 2 and both.count(b"[-]csi failed: rpc error") == 2
        reasons.pop("csi")
    finally:
        threaded.stop()
        await asynchronous.stop()


def test_metrics_are_served_with_prometheus_clients_content_type() -> None:
    server = health_threads.HealthServer("127.0.0.1:0")
    server.start()
    try:
        answer = _exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")
    finally:
        server.stop()
    assert answer.startswith(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=1.0.0; charset=utf-8\r\n")
    assert b"# TYPE process_resident_memory_bytes gauge" in answer


@pytest.mark.parametrize("module", ["node_driver_registrar.main", "livenessprobe.main"])
def test_the_node_sidecars_import_no_asyncio_grpc_protobuf_or_prometheus_client(module: str) -> None:
    found = imported_packages(
        module, ("asyncio", "grpc", "google.protobuf", "prometheus_client", "uvloop", "aiohttp")
    )
    assert found == [], f"{module} imports {found}"


def test_grpc_timeout_stays_within_eight_digits_in_the_finest_unit() -> None:
    assert framing.timeout_header(0.0001) == "1m"
    assert framing.timeout_header(10) == "10000m"
    assert framing.timeout_header(86_400) == "86400000m"
    assert framing.timeout_header(200_000) == "200000S"
    assert framing.timeout_header(1e12) == "99999999H"


def test_header_blocks_that_change_the_decoders_table_are_told_apart() -> None:
    """What grpcio sends first (literals with incremental indexing) changes the table; what it sends
    once they are in it (indexed fields, a literal without indexing) does not; a size update does."""
    encoder = Encoder()
    first = encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
    again = encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
    unindexed = b"\xbe" + b"\x00\x0cgrpc-message\x00"  # indexed entry, then a literal not indexed
    huffman_never = encoder.encode([("grpc-message", "x" * 300)], huffman=True)
    assert aio._changes_table(first)
    assert not aio._changes_table(again)
    assert not aio._changes_table(unindexed)
    assert aio._changes_table(huffman_never)  # a new name and value: indexed by hpack's encoder
    assert aio._changes_table(b"\x3f\xe1\x1f")  # a dynamic table size update (4096)
    assert not aio._changes_table(b"\x10\x04name\x7f\x81\x01" + b"v" * 256)  # never indexed, long value
