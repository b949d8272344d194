"""`--drivername`: the driver under another name, as csi-driver-host-path's flag of that name allows, so
it can stand where a manifest written for another driver expects that driver's name (the kind test of
upstream's storage-csi manifests runs it as hostpath.csi.k8s.io). Every place the name shows must
then say the new one: GetPluginInfo, kubelet's registration, the operation metric's label, and the
directory an inline volume is staged in, and the topology key, which follows the name."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from csi_driver import DRIVER_NAME
from kubeloop_grpc.csi import csi_pb2
from kubeloop_grpc.pluginregistration import api_pb2, api_pb2_grpc

from .conftest import REPO, Client, Driver, stop_and_clean
from .processes import free_port

OTHER_NAME = "hostpath.csi.k8s.io"
MOUNT = csi_pb2.VolumeCapability(
    mount=csi_pb2.VolumeCapability.MountVolume(fs_type="ext4"),
    access_mode=csi_pb2.VolumeCapability.AccessMode(
        mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
    ),
)


@pytest.fixture
def renamed(csi_root: Path) -> Iterator[tuple[Driver, int]]:
    work = Path(tempfile.mkdtemp(prefix="t", dir=csi_root))
    (work / "registry").mkdir()
    port = free_port()
    d = Driver(
        work,
        extra=[
            f"--drivername={OTHER_NAME}",
            f"--kubelet-registration-dir={work / 'registry'}",
            f"--http-endpoint=127.0.0.1:{port}",
        ],
    ).start()
    try:
        yield d, port
    finally:
        stop_and_clean(d, work)


def test_the_driver_answers_and_registers_under_the_name_it_is_given(renamed: tuple[Driver, int]) -> None:
    d, port = renamed
    client = Client(d.endpoint)
    try:
        info = client.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=5)
        assert info.name == OTHER_NAME
        # Its topology key follows the name, so its nodes' labels tell them from kubeloop's own.
        key = f"topology.loop.csi.kubeloop.dev/{OTHER_NAME}"
        node = client.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=5)
        assert dict(node.accessible_topology.segments) == {key: "node-a"}
        made = client.controller.CreateVolume(
            csi_pb2.CreateVolumeRequest(
                name="pvc-renamed",
                capacity_range=csi_pb2.CapacityRange(required_bytes=16 << 20),
                volume_capabilities=[MOUNT],
                accessibility_requirements=csi_pb2.TopologyRequirement(
                    requisite=[csi_pb2.Topology(segments={key: "node-a"})]
                ),
            ),
            timeout=60,
        ).volume
        assert [dict(t.segments) for t in made.accessible_topology] == [{key: "node-a"}]
        client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=made.volume_id), timeout=60)
        # An inline volume, staged in the plugin's own directory under kubelet's, which carries its name.
        target = d.kubelet / "pods" / "p1" / "volumes" / "v"
        volume_id = "csi-0f3a9c"
        client.node.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(
                volume_id=volume_id,
                target_path=str(target),
                volume_capability=MOUNT,
                volume_context={"csi.storage.k8s.io/ephemeral": "true", "size": "16Mi"},
            ),
            timeout=60,
        )
        try:
            assert (d.kubelet / "plugins" / OTHER_NAME / "ephemeral" / volume_id).is_dir()
            assert not (d.kubelet / "plugins" / DRIVER_NAME).exists()
        finally:
            client.node.NodeUnpublishVolume(
                csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target)), timeout=60
            )
    finally:
        client.close()
    reg_sock = d.root / "registry" / f"{OTHER_NAME}-reg.sock"
    with grpc.insecure_channel(f"unix://{reg_sock}") as channel:  # as kubelet's plugin watcher asks
        assert (
            api_pb2_grpc.RegistrationStub(channel).GetInfo(api_pb2.InfoRequest(), timeout=5).name
            == OTHER_NAME
        )
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as rsp:
        metrics = rsp.read().decode()
    assert f'csi_operations_seconds_count{{driver_name="{OTHER_NAME}",grpc_status_code="OK",' in metrics
    assert f'driver_name="{DRIVER_NAME}"' not in metrics


@pytest.mark.parametrize("name", ["-leading.dash", "trailing.", "with space", "a" * 64, ""])
def test_a_name_the_csi_spec_forbids_is_refused_at_start(name: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "csi_driver.main", f"--drivername={name}"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "is not a CSI driver name" in result.stderr, result.stderr
