"""The node sidecars against the real node plugin: kubeloop-node-driver-registrar, with the test
playing kubelet on its registration socket, and kubeloop-livenessprobe."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from csi_driver import DRIVER_NAME
from kubeloop_grpc.pluginregistration import api_pb2, api_pb2_grpc
from localstack.proc import free_ports
from tests.support.waits import eventually

from .conftest import REPO, Driver

# Where kubelet on the host would reach the driver: only handed on, never opened.
HOST_SOCKET = f"/var/lib/kubelet/plugins/{DRIVER_NAME}/csi.sock"


class Sidecar:
    """`python -m <module>` as a subprocess with its log in a file, and its /healthz."""

    def __init__(self, work: Path, module: str, *argv: str) -> None:
        (self.port,) = free_ports(1)
        self.log = work / f"{module.split('.')[0]}.log"
        cmd = [sys.executable, "-m", module, "--http-endpoint", f"127.0.0.1:{self.port}", "-v", "4", *argv]
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT)

    def healthz(self) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        def seen() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            return condition()

        eventually(what, seen, timeout, interval=0.05, context=lambda: self.log.read_text()[-4000:])

    def wait_serving(self) -> None:
        def up() -> bool:
            try:
                self.healthz()
                return True
            except OSError:
                return False

        self.wait_for(up, "the http endpoint")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@pytest.fixture
def work(csi_root: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix="s", dir=csi_root))  # short: socket paths have 107 bytes


@pytest.fixture
def node_driver(work: Path) -> Iterator[Driver]:
    """A node plugin without its own registration: the sidecar does that."""
    d = Driver(work, "node", "node-s")
    try:
        yield d
    finally:
        d.stop()


def registrar(work: Path, driver: Driver) -> Sidecar:
    return Sidecar(
        work,
        "node_driver_registrar.main",
        "--csi-address",
        driver.endpoint,
        "--kubelet-registration-path",
        HOST_SOCKET,
        "--plugin-registration-path",
        str(work / "registry"),
    )


def test_registrar_registers_the_driver_and_removes_its_socket_on_sigterm(
    work: Path, node_driver: Driver
) -> None:
    reg_sock = work / "registry" / f"{DRIVER_NAME}-reg.sock"
    sidecar = registrar(work, node_driver)  # before the driver: it waits for it to answer
    try:
        sidecar.wait_serving()
        status, body = sidecar.healthz()
        assert status == 500 and "not served yet" in body
        node_driver.start()
        sidecar.wait_for(reg_sock.exists, "the registration socket")
        assert stat.S_IMODE(os.lstat(reg_sock).st_mode) & 0o117 == 0, "0660 or stricter"
        with grpc.insecure_channel(f"unix://{reg_sock}") as channel:  # kubelet's plugin watcher
            stub = api_pb2_grpc.RegistrationStub(channel)
            info = stub.GetInfo(api_pb2.InfoRequest(), timeout=5)
            assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
                "CSIPlugin",
                DRIVER_NAME,
                HOST_SOCKET,
                ["1.0.0"],
            )
            stub.NotifyRegistrationStatus(api_pb2.RegistrationStatus(plugin_registered=True), timeout=5)
        assert sidecar.healthz() == (200, "ok")
    finally:
        code = sidecar.stop()
    assert code == 0, sidecar.log.read_text()[-4000:]
    assert not reg_sock.exists()
    assert node_driver.proc is not None and node_driver.proc.poll() is None, "the driver is not touched"


def test_registrar_exits_1_when_kubelet_refuses_the_plugin(work: Path, node_driver: Driver) -> None:
    node_driver.start()
    reg_sock = work / "registry" / f"{DRIVER_NAME}-reg.sock"
    sidecar = registrar(work, node_driver)
    try:
        sidecar.wait_for(reg_sock.exists, "the registration socket")
        with grpc.insecure_channel(f"unix://{reg_sock}") as channel:
            api_pb2_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
                api_pb2.RegistrationStatus(plugin_registered=False, error="unsupported version"), timeout=5
            )
        code = sidecar.proc.wait(timeout=20)
    finally:
        sidecar.stop()
    assert code == 1, sidecar.log.read_text()[-4000:]
    assert "unsupported version" in sidecar.log.read_text()


def livenessprobe(work: Path, address: str) -> Sidecar:
    return Sidecar(work, "livenessprobe.main", "--csi-address", address, "--probe-timeout", "3s")


def test_livenessprobe_follows_the_driver(work: Path, node_driver: Driver) -> None:
    node_driver.start()
    sidecar = livenessprobe(work, node_driver.endpoint)
    try:
        sidecar.wait_serving()
        assert sidecar.healthz() == (200, "ok")
        # Once the driver's name is known it labels the Probe calls' latency.
        probes = (
            'csi_sidecar_operations_seconds_count{driver_name="loop.csi.kubeloop.dev",'
            'grpc_status_code="OK",method_name="/csi.v1.Identity/Probe"}'
        )

        def probe_counted() -> bool:
            sidecar.healthz()
            with urllib.request.urlopen(f"http://127.0.0.1:{sidecar.port}/metrics", timeout=5) as resp:
                return probes in resp.read().decode()

        sidecar.wait_for(probe_counted, "the Probe metric")
        node_driver.stop()
        status, body = sidecar.healthz()
        assert status == 500 and "code = Unavailable" in body, body
    finally:
        assert sidecar.stop() == 0, sidecar.log.read_text()[-4000:]


def test_livenessprobe_fails_without_a_driver(work: Path) -> None:
    sidecar = livenessprobe(work, f"unix://{work / 'absent.sock'}")
    try:
        sidecar.wait_serving()
        status, body = sidecar.healthz()
        assert status == 500 and "code = Unavailable" in body, body
    finally:
        assert sidecar.stop() == 0, sidecar.log.read_text()[-4000:]
