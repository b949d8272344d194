"""The node agent's pure parts: kubelet's order of unmount / mount / unstage, what volumesInUse
holds, and vol_data.json on disk."""

from __future__ import annotations

from pathlib import Path

from controller_runtime.kinds import Pod
from controller_runtime.volumes import (
    CSIVolume,
    inline_csi_volumes,
    inline_volume_handle,
    pod_info_attributes,
    unique_volume_name,
)
from services.node_agent.decide import Mounted, PodVolume, plan_volumes
from services.node_agent.disk import Layout, VolData, read_vol_data, remove_volume_dir, write_vol_data

DRIVER = "loop.csi.kubeloop.dev"


def pv(handle: str) -> CSIVolume:
    return CSIVolume(f"pv-{handle}", DRIVER, handle, ("ReadWriteOnce",), False, "ext4", False, (), {})


def want(uid: str, handle: str) -> PodVolume:
    return PodVolume(uid, f"ns/{uid}", pv(handle), False)


def mounted(uid: str, handle: str) -> Mounted:
    return Mounted(uid, f"pv-{handle}", DRIVER, handle, False)


def test_new_pod_volume_is_reported_in_use_and_mounted() -> None:
    plan = plan_volumes([want("u1", "v1")], {}, set(), set())
    assert [m.key for m in plan.mount] == [("u1", "pv-v1")]
    assert plan.in_use == (unique_volume_name(DRIVER, "v1"),)


def test_gone_pod_is_unmounted_and_stays_in_use_until_unstaged() -> None:
    m = {("u1", "pv-v1"): mounted("u1", "v1")}
    plan = plan_volumes([], m, {("u1", "pv-v1")}, {(DRIVER, "v1")})
    assert plan.unmount == [mounted("u1", "v1")]
    assert plan.unstage == [], "never unstage while a publish remains"
    assert plan.in_use == (unique_volume_name(DRIVER, "v1"),)
    plan = plan_volumes([], {}, set(), {(DRIVER, "v1")})
    assert plan.unstage == [(DRIVER, "v1")]
    assert plan.in_use == (unique_volume_name(DRIVER, "v1"),), "in use until the unstage finished"
    assert plan_volumes([], {}, set(), set()).in_use == ()


def test_volume_shared_by_two_pods_stays_staged_for_the_other() -> None:
    m = {("u1", "pv-v1"): mounted("u1", "v1"), ("u2", "pv-v1"): mounted("u2", "v1")}
    plan = plan_volumes([want("u2", "v1")], m, set(m), {(DRIVER, "v1")})
    assert [x.pod_uid for x in plan.unmount] == ["u1"]
    assert plan.unstage == [] and plan.mount == []


def test_unconfirmed_publish_after_restart_is_published_again() -> None:
    m = {("u1", "pv-v1"): mounted("u1", "v1")}
    plan = plan_volumes([want("u1", "v1")], m, set(), {(DRIVER, "v1")})
    assert [x.key for x in plan.mount] == [("u1", "pv-v1")]
    assert plan.unmount == []


def test_an_inline_volume_is_published_and_unpublished_but_never_staged_or_in_use() -> None:
    pod: Pod = {
        "metadata": {"name": "app", "namespace": "ns", "uid": "u1"},
        "spec": {
            "serviceAccountName": "builder",
            "volumes": [
                {"name": "data", "persistentVolumeClaim": {"claimName": "c"}},
                {"name": "scratch", "csi": {"driver": DRIVER, "fsType": "xfs", "readOnly": True,
                                            "volumeAttributes": {"size": "1Gi"}}},
            ],
        },
    }  # fmt: skip
    (inline,) = inline_csi_volumes(pod)
    assert inline.ephemeral and inline.pv_name == "scratch" and inline.read_only and inline.fs_type == "xfs"
    # kubelet's handle: csi- and the SHA-256 of the pod's UID and the volume's name.
    assert inline.handle == inline_volume_handle("u1", "scratch")
    assert inline.handle == "csi-c8c135b044e4505c2e1d97317834afdda287006a636d3f503243e6d708883cb4"
    assert pod_info_attributes(pod, ephemeral=True) == {
        "csi.storage.k8s.io/pod.name": "app",
        "csi.storage.k8s.io/pod.namespace": "ns",
        "csi.storage.k8s.io/pod.uid": "u1",
        "csi.storage.k8s.io/serviceAccount.name": "builder",
        "csi.storage.k8s.io/ephemeral": "true",
    }
    wanted = PodVolume("u1", "ns/app", inline, True)
    plan = plan_volumes([wanted], {}, set(), set())
    assert plan.mount == [wanted] and plan.in_use == ()
    gone = Mounted("u1", "scratch", DRIVER, inline.handle, False, ephemeral=True)
    plan = plan_volumes([], {("u1", "scratch"): gone}, {("u1", "scratch")}, set())
    assert plan.unmount == [gone] and plan.unstage == [] and plan.in_use == ()


def test_vol_data_roundtrip_and_layout(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    target = layout.target_path("uid-1", "pv-1", block=False)
    assert target == tmp_path / "pods/uid-1/volumes/kubernetes.io~csi/pv-1/mount"
    assert layout.staging_path(DRIVER, "v1").name == "globalmount"
    data = VolData("pv-1", "v1", DRIVER, "node-a", podUID="uid-1")
    write_vol_data(target.parent / "vol_data.json", data)
    write_vol_data(layout.staging_dir(DRIVER, "v1") / "vol_data.json", data)
    assert layout.published() == {("uid-1", "pv-1"): data}
    assert layout.staged() == {(DRIVER, "v1"): data}
    (target.parent / "vol_data.json").write_text("{torn")
    assert read_vol_data(target.parent / "vol_data.json") is None
    target.mkdir()
    remove_volume_dir(target.parent, "mount", tmp_path / "pods")
    assert not (tmp_path / "pods" / "uid-1").exists()


def test_cleanup_never_removes_a_directory_with_data(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    target = layout.target_path("uid-1", "pv-1", block=False)
    target.mkdir(parents=True)
    (target / "precious").write_text("x")
    remove_volume_dir(target.parent, "mount", tmp_path / "pods")
    assert (target / "precious").read_text() == "x"
