"""`docker-compose up` end to end: a claim and a pod on node-a, the data moved to node-b, expansion,
deletion down to the backing file, restarts or kill -9 of single services converging, and the whole
stack stopped and started again while a pod uses a volume."""

from __future__ import annotations

import functools
import json

from tests.support.waits import WaitFailed, eventually

from .conftest import Stack

NS = "default"


def claim_and_pod(claim: str, pod: str, node: str, size: str = "64Mi") -> str:
    return f"""
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {claim}}}
spec:
  accessModes: [ReadWriteOnce]
  resources: {{requests: {{storage: {size}}}}}
---
{pod_yaml(pod, claim, node)}
"""


def pod_yaml(pod: str, claim: str, node: str) -> str:
    return f"""
apiVersion: v1
kind: Pod
metadata: {{name: {pod}}}
spec:
  nodeName: {node}
  containers: [{{name: app, image: busybox, volumeMounts: [{{name: data, mountPath: /data}}]}}]
  volumes: [{{name: data, persistentVolumeClaim: {{claimName: {claim}}}}}]
"""


def get(s: Stack, kind: str, name: str) -> dict[str, object] | None:
    out = s.kubectl("get", kind, name, "-n", NS, "-o", "json", "--ignore-not-found")
    return json.loads(out) if out.strip() else None


def pod_volume_dir(s: Stack, pod: str, node: str) -> str:
    uid = s.kubectl("get", "pod", pod, "-n", NS, "-o", "jsonpath={.metadata.uid}")
    pv = s.kubectl(
        "get", "pod", pod, "-n", NS, "-o", "jsonpath={.spec.volumes[0].persistentVolumeClaim.claimName}"
    )
    volume = s.kubectl("get", "pvc", pv, "-n", NS, "-o", "jsonpath={.spec.volumeName}")
    return f"/var/lib/kubeloop/nodes/{node}/kubelet/pods/{uid}/volumes/kubernetes.io~csi/{volume}/mount"


def wait_running_and_mounted(s: Stack, pod: str, node: str) -> str:
    eventually(
        f"{pod} Running",
        lambda: s.kubectl("get", "pod", pod, "-o", "jsonpath={.status.phase}") == "Running",
        90,
        0.5,
    )
    path = pod_volume_dir(s, pod, node)
    # The node plugin mounted it; the node agent (another container) sees it through rshared.
    eventually(f"{path} mounted on {node}", lambda: s.mounted(f"csi-driver-node-{node}", path), 90, 0.5)
    assert s.mounted(f"node-agent-{node}", path), "the node agent does not see the plugin's mount"
    return path


def attached(s: Stack, pv: str, node: str) -> bool:
    vas = json.loads(s.kubectl("get", "volumeattachments", "-o", "json"))["items"]
    return any(
        va["spec"]["source"].get("persistentVolumeName") == pv
        and va["spec"]["nodeName"] == node
        and va.get("status", {}).get("attached")
        for va in vas
    )


def backing_files(s: Stack) -> list[str]:
    return s.exec("csi-driver-controller", "ls /var/lib/kubeloop/pool/volumes/ 2>/dev/null || true").split()


def test_compose_config_validates(stack: Stack) -> None:
    stack.compose("config", "-q")


def test_claim_pod_move_expand_delete(stack: Stack) -> None:
    s = stack
    s.kubectl("apply", "-n", NS, "-f", "-", input=claim_and_pod("data", "app", "node-a"))
    eventually(
        "data Bound",
        lambda: s.kubectl("get", "pvc", "data", "-o", "jsonpath={.status.phase}") == "Bound",
        90,
        0.5,
    )
    pv = s.kubectl("get", "pvc", "data", "-o", "jsonpath={.spec.volumeName}")
    eventually("VolumeAttachment attached to node-a", lambda: attached(s, pv, "node-a"), 90, 0.5)
    path = wait_running_and_mounted(s, "app", "node-a")
    s.exec("csi-driver-node-node-a", f"echo kubeloop-compose > {path}/hello && sync")

    # The pod moves to node-b: detached from node-a, attached to node-b, the data is there.
    s.kubectl("delete", "pod", "app", "-n", NS, "--wait=true", "--timeout=90s")
    eventually("detach from node-a", lambda: not attached(s, pv, "node-a"), 90, 0.5)
    s.kubectl("apply", "-n", NS, "-f", "-", input=pod_yaml("app", "data", "node-b"))
    eventually("VolumeAttachment attached to node-b", lambda: attached(s, pv, "node-b"), 90, 0.5)
    path = wait_running_and_mounted(s, "app", "node-b")
    assert s.exec("csi-driver-node-node-b", f"cat {path}/hello").strip() == "kubeloop-compose"

    # Expansion: the resizer grows the file, the node agent the filesystem. Online ext4 growth needs
    # CAP_SYS_RESOURCE, which a sandboxed docker may not grant even to a privileged container; the
    # driver then refuses with FailedPrecondition and grows it at the next staging, as kubelet would
    # on the pod's restart.
    s.kubectl(
        "patch", "pvc", "data", "-n", NS, "-p", '{"spec":{"resources":{"requests":{"storage":"128Mi"}}}}'
    )

    def capacity() -> str:
        return s.kubectl("get", "pvc", "data", "-o", "jsonpath={.status.capacity.storage}")

    def resize_state() -> str:
        return s.kubectl("get", "pvc", "data", "-o", "jsonpath={.status.allocatedResourceStatuses.storage}")

    eventually(
        "the volume grown",
        lambda: capacity() == "128Mi" or resize_state() == "NodeResizeInProgress",
        120,
        0.5,
    )
    try:
        eventually("the claim's capacity at 128Mi, grown online", lambda: capacity() == "128Mi", 30, 0.5)
    except WaitFailed:  # grown offline: at the next mount
        s.kubectl("delete", "pod", "app", "-n", NS, "--wait=true", "--timeout=90s")
        eventually("detach from node-b", lambda: not attached(s, pv, "node-b"), 90, 0.5)
        s.kubectl("apply", "-n", NS, "-f", "-", input=pod_yaml("app", "data", "node-b"))
        eventually("the claim's capacity at 128Mi after the restart", lambda: capacity() == "128Mi", 120, 0.5)
        path = wait_running_and_mounted(s, "app", "node-b")
    assert s.exec("csi-driver-node-node-b", f"cat {path}/hello").strip() == "kubeloop-compose"
    size_kib = int(s.exec("csi-driver-node-node-b", f"df -k --output=size {path} | tail -1").strip())
    assert size_kib > 100 * 1024, f"the filesystem is {size_kib} KiB after expansion to 128Mi"

    # Deleting everything deletes the PV and its backing file.
    assert len(backing_files(s)) == 1
    s.kubectl("delete", "pod", "app", "-n", NS, "--wait=true", "--timeout=90s")
    s.kubectl("delete", "pvc", "data", "-n", NS, "--wait=true", "--timeout=90s")
    eventually(f"PV {pv} deleted", lambda: get(s, "pv", pv) is None, 90, 0.5)
    eventually("the backing file deleted", lambda: backing_files(s) == [], 90, 0.5)
    assert s.pool_loop_devices() == [], "a loop device outlived its volume"


def test_restart_and_kill_converge(stack: Stack) -> None:
    s = stack
    s.kubectl("apply", "-n", NS, "-f", "-", input=claim_and_pod("keep", "keeper", "node-a"))
    eventually(
        "keep Bound",
        lambda: s.kubectl("get", "pvc", "keep", "-o", "jsonpath={.status.phase}") == "Bound",
        90,
        0.5,
    )
    path = wait_running_and_mounted(s, "keeper", "node-a")
    s.exec("csi-driver-node-node-a", f"echo still-here > {path}/kept && sync")

    s.compose("restart", "pv-controller")
    # kill -9 of each container's main process (the child of its init, tini, which then exits), as an
    # OOM kill or a crash would: the restart policy brings the container back. (`docker kill` would
    # not do: docker treats it as a manual stop and skips the restart policy.)
    # The provisioner's from inside its container: `kill -9 -1` reaches every process but init.
    killed = ("external-provisioner", "csi-driver-node-node-a", "node-agent-node-a", "kube-apiserver")
    restarts = {service: s.restarts(service) for service in killed}
    s.exec("external-provisioner", "kill -9 -1", check=False)
    for service in killed[1:]:
        s.kill_main_process(service)
    for service, before in restarts.items():  # the kills landed: each container was restarted
        eventually(
            f"{service} restarted", functools.partial(s.restarts, service), 60, 0.5, satisfied=before.__lt__
        )
    s.wait_healthy(timeout=180)

    # Nothing lost: the mounted volume and its data stay, and new work goes through.
    assert s.mounted("csi-driver-node-node-a", path)
    assert s.exec("csi-driver-node-node-a", f"cat {path}/kept").strip() == "still-here"
    s.kubectl("apply", "-n", NS, "-f", "-", input=claim_and_pod("after", "after", "node-b"))
    eventually(
        "after Bound",
        lambda: s.kubectl("get", "pvc", "after", "-o", "jsonpath={.status.phase}") == "Bound",
        90,
        0.5,
    )
    wait_running_and_mounted(s, "after", "node-b")

    for pod, claim in (("keeper", "keep"), ("after", "after")):
        s.kubectl("delete", "pod", pod, "-n", NS, "--wait=true", "--timeout=90s")
        s.kubectl("delete", "pvc", claim, "-n", NS, "--wait=true", "--timeout=90s")
    eventually("every PV deleted", lambda: s.kubectl("get", "pv", "-o", "name") == "", 90, 0.5)
    eventually("every backing file deleted", lambda: backing_files(s) == [], 90, 0.5)
    assert s.pool_loop_devices() == [], "a loop device outlived its volume"


def _pod_with_data(s: Stack, name: str) -> str:
    """A claim and a pod on node-a, a file written into the volume; returns the pod's mount path."""
    s.kubectl("apply", "-n", NS, "-f", "-", input=claim_and_pod(name, name, "node-a"))
    eventually(
        f"{name} Bound",
        lambda: s.kubectl("get", "pvc", name, "-o", "jsonpath={.status.phase}") == "Bound",
        90,
        0.5,
    )
    path = wait_running_and_mounted(s, name, "node-a")
    s.exec("csi-driver-node-node-a", f"echo {name} > {path}/kept && sync")
    assert s.pool_loop_devices(), "the volume's loop device is attached"
    return path


def _up_again(s: Stack, name: str) -> str:
    up = s.compose("up", "-d", timeout=600, check=False)
    assert up.returncode == 0, up.stderr[-3000:]
    s.wait_healthy()
    path = wait_running_and_mounted(s, name, "node-a")
    assert s.exec("csi-driver-node-node-a", f"cat {path}/kept").strip() == name
    return path


def _delete_pod_and_claim(s: Stack, name: str) -> None:
    s.kubectl("delete", "pod", name, "-n", NS, "--wait=true", "--timeout=90s")
    s.kubectl("delete", "pvc", name, "-n", NS, "--wait=true", "--timeout=90s")
    eventually("every PV deleted", lambda: s.kubectl("get", "pv", "-o", "name") == "", 90, 0.5)
    eventually("every backing file deleted", lambda: backing_files(s) == [], 90, 0.5)
    assert s.pool_loop_devices() == [], "a loop device outlived its volume"


def test_stop_with_a_mounted_volume_leaves_nothing_and_up_mounts_again(stack: Stack) -> None:
    """Issue 29, hole 8: `docker-compose stop` (what `down` does first) while a pod uses a volume.
    Compose stops each node agent before its node plugin, and the agent unmounts its node's volumes
    on SIGTERM: no mount and no loop device may stay. The pod is kept in etcd (the `etcd-data`
    volume) and its data in the `pool` volume: `up` again mounts it again."""
    s = stack
    _pod_with_data(s, "stays")
    s.compose("stop", timeout=300)
    mounts, loops = s.leftovers()
    assert not mounts and not loops, f"left behind by the stop: mounts {mounts} loop devices {loops}"
    _up_again(s, "stays")
    _delete_pod_and_claim(s, "stays")


def test_kill_leaves_the_volume_mounted_until_up_takes_it_over(stack: Stack) -> None:
    """`docker-compose kill` gives no node agent a chance to unmount: the mounts and the loop device
    stay (docs/compose.md, "Stopping"); the next `up` takes them over as they are (one mount, the
    same loop device) and its stop leaves nothing."""
    s = stack
    path = _pod_with_data(s, "killed")
    s.compose("kill", timeout=300)
    mounts, loops = s.leftovers()
    assert len(loops) == 1 and any(m.endswith(path.rpartition("/nodes/")[2]) for m in mounts), (mounts, loops)
    path = _up_again(s, "killed")
    table = s.exec("csi-driver-node-node-a", "findmnt -rn -o TARGET").split()
    assert table.count(path) == 1, "taken over, not mounted a second time"
    assert s.pool_loop_devices() == loops, "the same loop device, no second one"
    s.compose("stop", timeout=300)
    mounts, loops = s.leftovers()
    assert not mounts and not loops, f"left behind by the stop: mounts {mounts} loop devices {loops}"
    _up_again(s, "killed")
    _delete_pod_and_claim(s, "killed")


def test_snapshot_and_restore(stack: Stack) -> None:
    """VolumeSnapshots in compose: upstream's snapshot-controller and csi-snapshotter services (their
    CRDs applied by the setup service) take a copy of a claim's volume; a claim restored from it on
    the other node holds the data; deleting the snapshot deletes the copy."""
    s = stack
    _pod_with_data(s, "snapsrc")
    s.kubectl("delete", "pod", "snapsrc", "-n", NS, "--wait=true", "--timeout=90s")
    snapshot = """
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: snap}
spec: {volumeSnapshotClassName: kubeloop, source: {persistentVolumeClaimName: snapsrc}}
"""
    s.kubectl("apply", "-n", NS, "-f", "-", input=snapshot)
    eventually(
        "the snapshot ready",
        lambda: s.kubectl("get", "volumesnapshot", "snap", "-o", "jsonpath={.status.readyToUse}") == "true",
        90,
        0.5,
    )
    assert s.exec("csi-driver-controller", "ls /var/lib/kubeloop/pool/snapshots").split(), (
        "no copy in the pool"
    )
    restored = """
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: restored}
spec:
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 64Mi}}
  dataSource: {apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: snap}
---
"""
    s.kubectl("apply", "-n", NS, "-f", "-", input=restored + pod_yaml("restored", "restored", "node-b"))
    path = wait_running_and_mounted(s, "restored", "node-b")
    assert s.exec("csi-driver-node-node-b", f"cat {path}/kept").strip() == "snapsrc"
    s.kubectl("delete", "volumesnapshot", "snap", "-n", NS, "--wait=true", "--timeout=90s")
    eventually(
        "the snapshot's copy deleted",
        lambda: not s.exec("csi-driver-controller", "ls /var/lib/kubeloop/pool/snapshots").split(),
        90,
        0.5,
    )
    s.kubectl("delete", "pod", "restored", "-n", NS, "--wait=true", "--timeout=90s")
    for claim in ("restored", "snapsrc"):
        s.kubectl("delete", "pvc", claim, "-n", NS, "--wait=true", "--timeout=90s")
    eventually("every PV deleted", lambda: s.kubectl("get", "pv", "-o", "name") == "", 90, 0.5)
    eventually("every backing file deleted", lambda: backing_files(s) == [], 90, 0.5)
