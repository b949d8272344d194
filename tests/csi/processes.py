"""Driver processes in the tests of tests/csi: a free port, `running` drivers (ready, then stopped
and cleaned up), whether one serves its socket and what its /readyz says, the records its state
directory holds, and a clone killed -9 while it copies."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from kubeloop_grpc.csi import csi_pb2
from tests.support.waits import eventually

from .conftest import Client, Driver, stop_and_clean
from .volumes import MiB, create, mount_cap


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running(*drivers: Driver) -> Iterator[list[Client]]:
    """Waits for the drivers to be ready and yields a client for each; afterwards every driver
    unstages what it still stages and stops, and its directory is cleaned up."""
    clients: list[Client] = []
    try:
        for d in drivers:
            d.wait_ready()
            clients.append(Client(d.endpoint))
        yield clients
    finally:
        for c in clients:
            c.close()
        for d in drivers:
            stop_and_clean(d, d.root)


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as rsp:
            return rsp.status, rsp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_serving(d: Driver, timeout: float = 30.0) -> None:
    """Until the socket answers (the plugin is up, though not healthy)."""

    def serving() -> bool:
        assert d.proc is not None and d.proc.poll() is None, d.log.read_text()[-4000:]
        if not d.socket.exists():
            return False
        client = Client(d.endpoint)
        try:
            client.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=2)
            return True
        finally:
            client.close()

    eventually(
        "the driver serving its socket",
        serving,
        timeout,
        interval=0.05,
        ignoring=(grpc.RpcError,),
        context=lambda: d.log.read_text()[-4000:],
    )


def records(state: Path, kind: str) -> dict[str, dict[str, object]]:
    directory = state / kind
    return {p.stem: json.loads(p.read_text()) for p in directory.glob("*.json")} if directory.exists() else {}


def kill_during_clone(
    driver: Driver, client: Client, source_name: str, name: str, **extra: Any
) -> tuple[csi_pb2.Volume, csi_pb2.CreateVolumeRequest]:
    """A 512 MiB source with 384 MiB of data, and its clone `name` (the request given `extra`
    fields) killed -9 once its record is written and not ready, while the copy runs. Returns the
    source and the clone's request, for the retry."""
    source = create(client, source_name, size=512 * MiB)
    with open(driver.pool / "volumes" / f"{source.volume_id}.img", "r+b") as f:
        for _ in range(384):
            f.write(os.urandom(MiB))
    request = csi_pb2.CreateVolumeRequest(
        name=name,
        capacity_range=csi_pb2.CapacityRange(required_bytes=512 * MiB),
        volume_capabilities=[mount_cap()],
        volume_content_source=csi_pb2.VolumeContentSource(
            volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=source.volume_id)
        ),
        **extra,
    )
    errors: list[grpc.RpcError] = []

    def clone() -> None:
        try:
            client.controller.CreateVolume(request, timeout=30)
        except grpc.RpcError as e:
            errors.append(e)

    worker = threading.Thread(target=clone)
    worker.start()
    eventually(
        "the clone's record, not ready",
        lambda: any(not r.get("ready") for r in records(driver.state, "volumes").values()),
        timeout=20,
        interval=0.001,
    )
    driver.kill9()
    worker.join()
    assert errors, "the clone finished before the kill; the copy was too fast to interrupt"
    return source, request
