"""Inline (CSI ephemeral) volumes as kubelet publishes them, shared by the tests of tests/csi: the
pod's attributes, a volume's `handle` and target, `publish_with`, `unpublish`, a publish killed -9
part way (`publish_killed`) and `nothing_left` of any afterwards."""

from __future__ import annotations

import hashlib
import threading
import time

import grpc

from kubeloop_grpc.csi import csi_pb2

from .conftest import Client, Driver, loop_devices_under, mounts_under
from .volumes import mount_cap

POD_INFO = {
    "csi.storage.k8s.io/pod.name": "app",
    "csi.storage.k8s.io/pod.namespace": "default",
    "csi.storage.k8s.io/pod.uid": "7d2c0c0e-0000-4000-8000-000000000001",
    "csi.storage.k8s.io/serviceAccount.name": "default",
    "csi.storage.k8s.io/ephemeral": "true",
}


def handle(name: str) -> str:
    return "csi-" + hashlib.sha256(f"{POD_INFO['csi.storage.k8s.io/pod.uid']}{name}".encode()).hexdigest()


def target_of(driver: Driver, name: str) -> str:
    return str(driver.kubelet / "pods" / "uid" / "volumes" / "kubernetes.io~csi" / name / "mount")


def publish(client: Client, driver: Driver, name: str, timeout: float = 30, **given: str) -> str:
    return publish_with(client, driver, name, given, timeout)


def publish_with(
    client: Client, driver: Driver, name: str, given: dict[str, str], timeout: float = 30
) -> str:
    attributes = dict(given)
    target = target_of(driver, name)
    client.node.NodePublishVolume(
        csi_pb2.NodePublishVolumeRequest(
            volume_id=handle(name),
            target_path=target,
            volume_capability=mount_cap(attributes.pop("capFsType", "")),
            volume_context={**POD_INFO, **attributes},
        ),
        timeout=timeout,
    )
    return target


def unpublish(client: Client, driver: Driver, name: str) -> None:
    client.node.NodeUnpublishVolume(
        csi_pb2.NodeUnpublishVolumeRequest(volume_id=handle(name), target_path=target_of(driver, name))
    )


def publish_killed(driver: Driver, name: str, given: dict[str, str], delay: float) -> None:
    """Publishes on a client of its own, kills the driver -9 `delay` seconds in (wherever the
    publish then is), and starts it again."""

    def run() -> None:
        client = Client(driver.endpoint)
        try:
            publish_with(client, driver, name, given, timeout=20)
        except grpc.RpcError:
            pass  # killed before it answered
        finally:
            client.close()

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(delay)
    driver.kill9()
    worker.join()
    driver.start()


def nothing_left(driver: Driver) -> None:
    assert not list((driver.pool / "ephemeral").iterdir()), "a backing file is left"
    assert not list((driver.state / "staging").glob("*.json")), "a staging record is left"
    assert not loop_devices_under(driver.pool), "a loop device is left"
    assert not mounts_under(driver.kubelet), "a mount is left"
