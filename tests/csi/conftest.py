"""Fixtures for the CSI tests: root check, a driver subprocess, and a session guard that no loop
device or mount is left behind by any test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from controller_runtime.mounts import read_mounts
from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc
from localstack.leftovers import loop_backing_files
from tests.support.waits import WaitFailed, eventually

REPO = Path(__file__).resolve().parents[2]


def require_root() -> None:
    """Driver tests need root, loop devices and mount: without them they fail (never skip), saying
    what is missing, so CI can never pass without running them."""
    problem = ""
    if os.geteuid() != 0:
        problem = "needs root (loop devices, mount); run the tests as root"
    elif not os.path.exists("/dev/loop-control"):
        problem = "needs /dev/loop-control; load the loop module (modprobe loop)"
    if problem:
        pytest.fail(f"CSI driver tests {problem}")


def loop_devices_under(root: Path) -> list[str]:
    return [dev for dev, back in loop_backing_files() if back.startswith(str(root))]


def mounts_under(root: Path) -> list[str]:
    points = [m.mountpoint for m in read_mounts()]
    return [p for p in points if p.startswith(str(root))]


def force_cleanup(root: Path) -> None:
    for point in sorted(mounts_under(root), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False)
    for dev in loop_devices_under(root):
        subprocess.run(["losetup", "-d", dev], check=False)


@pytest.fixture(scope="session")
def csi_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The directory every CSI test works under. At the end of the session no loop device may be
    backed by a file under it and nothing may be mounted under it."""
    require_root()
    root = tmp_path_factory.mktemp("csi")
    yield root
    leaked_loops, leaked_mounts = loop_devices_under(root), mounts_under(root)
    force_cleanup(root)
    assert not leaked_loops and not leaked_mounts, (
        f"the CSI tests left loop devices {leaked_loops} and mounts {leaked_mounts} behind"
    )


class Driver:
    """`python -m csi_driver.main` as a subprocess, so a test can kill -9 it and start it again."""

    def __init__(
        self,
        root: Path,
        mode: str = "all",
        node_id: str = "node-a",
        extra: Sequence[str] = (),
        pool: Path | None = None,
        env: dict[str, str] | None = None,
        module: str = "csi_driver.main",
    ) -> None:
        self.root = root
        self.module = module
        self.env = env
        self.socket = root / "csi.sock"
        self.pool = pool or root / "pool"
        self.state = root / "state"
        # Staging and target paths must lie under the driver's kubelet directory (--kubelet-dir).
        self.kubelet = root / "kubelet"
        self.mode = mode
        self.node_id = node_id
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "driver.log"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> Driver:
        return self.launch().wait_ready()

    def launch(self) -> Driver:
        """Starts the process without waiting for it."""
        cmd = [
            sys.executable,
            "-m",
            self.module,
            "--endpoint",
            self.endpoint,
            "--mode",
            self.mode,
            "--node-id",
            self.node_id,
            "--pool-dir",
            str(self.pool),
            "--state-dir",
            str(self.state),
            "--kubelet-dir",
            str(self.kubelet),
            "-v",
            "4",
            *self.extra,
        ]
        logf = open(self.log, "ab")  # noqa: SIM115 - handed to the child for its lifetime
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, env=self.env)
        logf.close()
        return self

    def wait_ready(self, timeout: float = 30.0) -> Driver:
        proc = self.proc
        assert proc is not None

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"driver exited with {proc.returncode}:\n{self.log.read_text()[-4000:]}")
            return self.socket.exists() and self._probe()

        try:
            eventually("the driver ready", ready, timeout, interval=0.05)
        except WaitFailed as e:
            raise RuntimeError(f"driver did not become ready: {e}\n{self.log.read_text()[-4000:]}") from None
        return self

    def _probe(self) -> bool:
        try:
            with grpc.insecure_channel(self.endpoint) as ch:
                rsp = csi_pb2_grpc.IdentityStub(ch).Probe(csi_pb2.ProbeRequest(), timeout=2)
                return bool(rsp.ready.value)
        except grpc.RpcError:
            return False

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class Client:
    """Blocking CSI stubs over the driver's socket."""

    def __init__(self, endpoint: str) -> None:
        self.channel = grpc.insecure_channel(endpoint)
        self.identity = csi_pb2_grpc.IdentityStub(self.channel)
        self.controller = csi_pb2_grpc.ControllerStub(self.channel)
        self.node = csi_pb2_grpc.NodeStub(self.channel)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def driver(csi_root: Path, request: pytest.FixtureRequest) -> Iterator[Driver]:
    """A `--mode all` driver in its own directory; on teardown every volume it still stages is
    unpublished and unstaged through the driver itself, then it gets SIGTERM."""
    # Short directory names: a unix socket path may not exceed 107 bytes.
    work = Path(tempfile.mkdtemp(prefix="t", dir=csi_root))
    (work / "test-name").write_text(request.node.name)
    d = Driver(work, "all", "node-a").start()
    try:
        yield d
    finally:
        stop_and_clean(d, work)


def stop_and_clean(d: Driver, work: Path) -> None:
    """A running driver unpublishes and unstages what it still stages, then gets SIGTERM; whatever
    is left under work is cleaned up by force."""
    if d.proc is not None and d.proc.poll() is None:
        client = Client(d.endpoint)
        try:
            teardown_volumes(client, d)
        finally:
            client.close()
        d.stop()
    force_cleanup(work)


def teardown_volumes(client: Client, d: Driver) -> None:
    staging_dir = d.state / "staging"
    for record in staging_dir.glob("*.json") if staging_dir.exists() else []:
        doc = json.loads(record.read_text())
        for target in doc.get("targets", {}):
            client.node.NodeUnpublishVolume(
                csi_pb2.NodeUnpublishVolumeRequest(volume_id=doc["volume_id"], target_path=target)
            )
        client.node.NodeUnstageVolume(
            csi_pb2.NodeUnstageVolumeRequest(
                volume_id=doc["volume_id"], staging_target_path=doc["staging_path"]
            )
        )


def start_second_node(driver: Driver) -> Driver:
    """Starts a node plugin for node-b on the pool of `driver` (the local stack's layout: one
    kernel, one pool); the caller stops it."""
    other = Driver(driver.root / "node-b", "node", "node-b")
    other.pool, other.state = driver.pool, driver.root / "node-b" / "state"
    other.root.mkdir()
    return other.start()


@pytest.fixture
def client(driver: Driver) -> Iterator[Client]:
    c = Client(driver.endpoint)
    yield c
    c.close()
