"""Node-local drivers that pull from each other (csi_driver.transfer), beside a real API server:
restores and clones on a node that does not hold the source, who may pull, and moves
(`kubectl kubeloop move`) with a kill -9 of either plugin, or of the command, at every step."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.resources import (
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    SERVICE_ACCOUNTS,
    VOLUME_SNAPSHOT_CONTENTS,
)
from controller_runtime.toolchain import REPO_ROOT
from controller_runtime.volume_moves import FROM_LABEL, PREFIX, TO_LABEL, affinity_node, node_affinity
from csi_driver.controller import PULL_KEPT_SECONDS, ControllerConfig, ControllerServer
from csi_driver.pool_kinds import PoolCapacity
from csi_driver.state import DriverState, VolumeRecord
from csi_driver.transfer import client as transfer_client
from csi_driver.transfer.errors import BadRequest, TransferDenied, TransferError
from csi_driver.transfer.moves import AFTER_DROP, AFTER_PULL, AFTER_RELEASE, AFTER_SWITCH
from csi_driver.transfer.snapshot_owners import MANAGED_BY
from kubectl_kubeloop.moves import _start as ask_for_move
from kubeloop_grpc.csi import csi_pb2
from localstack.controlplane import ControlPlane
from localstack.snapshotter import snapshot_crds
from tests.integration.provisioner_harness import kubectl
from tests.support.waits import eventually, eventually_async

from .cluster_nodes import (
    AUDIENCE,
    DRIVER,
    NAMESPACE,
    PLUGIN_ACCOUNT,
    SERVER_NAME,
    TOPOLOGY,
    ClusterNode,
    TransferCluster,
    chart_rbac,
    file_digest,
    force_delete_pod,
    plugin_pod,
    token_for,
    write_scattered,
)
from .conftest import Client, force_cleanup
from .volumes import MiB, block_cap, create

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture(loop_scope="session")
async def cluster(
    control_plane: ControlPlane, api: ApiClient, csi_root: Path
) -> AsyncIterator[TransferCluster]:
    rbac = csi_root / "transfer-rbac.yaml"
    rbac.write_text(chart_rbac())
    await kubectl(control_plane, "apply", "-f", str(rbac))
    for crd in snapshot_crds():
        await kubectl(control_plane, "apply", "-f", str(crd))
        await kubectl(control_plane, "wait", "--for=condition=established", "--timeout=60s", "-f", str(crd))
    c = TransferCluster(control_plane, api, csi_root)
    try:
        yield c
    finally:
        for node in c.nodes:
            node.driver.stop()
        await c.clean()
        for node in c.nodes:
            force_cleanup(node.driver.root)


def volume_file(node: ClusterNode, volume_id: str) -> Path:
    return node.driver.pool / "volumes" / f"{volume_id}.img"


def made_volume(client: Client, name: str, size: int, **kwargs: object) -> csi_pb2.Volume:
    return create(client, name, size, block_cap(), **kwargs)


async def start(
    cluster: TransferCluster, count: int, failpoints: dict[int, str] | None = None
) -> list[ClusterNode]:
    nodes = [await cluster.add_node(i, (failpoints or {}).get(i, "")) for i in range(count)]
    for n in nodes:
        n.driver.launch()
    for n in nodes:
        n.driver.wait_ready()
    return nodes


# --- restores and clones ------------------------------------------------------------------------------


def assert_restored(got: Path, snap_file: Path) -> None:
    """96 MiB restored from a 64 MiB snapshot: its data, then zeros, and holes kept (8 MiB of data
    take 8 MiB of disk, not 64)."""
    assert os.path.getsize(got) == 96 * MiB
    assert file_digest(got, 64 * MiB) == file_digest(snap_file)
    assert os.stat(got).st_blocks * 512 <= 9 * MiB


async def test_a_restore_and_a_clone_made_on_another_node_pull_their_source(cluster: TransferCluster) -> None:
    a, b = await start(cluster, 2)
    ca, cb = Client(a.driver.endpoint), Client(b.driver.endpoint)
    try:
        vol = made_volume(ca, "src", 64 * MiB)
        write_scattered(volume_file(a, vol.volume_id), 8)
        snap = ca.controller.CreateSnapshot(
            csi_pb2.CreateSnapshotRequest(name="snap", source_volume_id=vol.volume_id)
        ).snapshot
        snap_file = a.driver.pool / "snapshots" / f"{snap.snapshot_id}.img"

        # A restore larger than its snapshot, on node b, which does not hold it.
        source = csi_pb2.VolumeContentSource(
            snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snap.snapshot_id)
        )
        restored = made_volume(cb, "restored", 96 * MiB, volume_content_source=source)
        assert_restored(volume_file(b, restored.volume_id), snap_file)
        assert restored.content_source.snapshot.snapshot_id == snap.snapshot_id
        # The retry of the same CreateVolume answers the same volume.
        again = made_volume(cb, "restored", 96 * MiB, volume_content_source=source)
        assert again.volume_id == restored.volume_id

        clone_source = csi_pb2.VolumeContentSource(
            volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=vol.volume_id)
        )
        clone = made_volume(cb, "clone", 64 * MiB, volume_content_source=clone_source)
        assert file_digest(volume_file(b, clone.volume_id)) == file_digest(volume_file(a, vol.volume_id))

        # A source no node holds: NOT_FOUND, and nothing left behind on b.
        missing = csi_pb2.VolumeContentSource(
            snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id="snap-nowhere")
        )
        with pytest.raises(grpc.RpcError) as err:
            made_volume(cb, "orphan", 64 * MiB, volume_content_source=missing)
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
        assert "snap-nowhere is in the pool of no node" in str(err.value.details())
        assert sorted(p.name for p in (b.driver.pool / "volumes").iterdir()) == sorted(
            f"{v}.img" for v in (restored.volume_id, clone.volume_id)
        )
        secret = await cluster.tls_secret()
        assert sorted(secret) == ["ca.crt", "tls.crt", "tls.key"]
    finally:
        ca.close()
        cb.close()


async def test_a_pre_provisioned_snapshot_content_gets_the_label_of_the_node_that_holds_it(
    cluster: TransferCluster, api: ApiClient
) -> None:
    a, _ = await start(cluster, 2)
    ca = Client(a.driver.endpoint)
    try:
        vol = made_volume(ca, "backed-up", 32 * MiB)
        snap = ca.controller.CreateSnapshot(
            csi_pb2.CreateSnapshotRequest(name="backup", source_volume_id=vol.volume_id)
        ).snapshot
    finally:
        ca.close()
    name = f"pre-{cluster.suffix}"
    await api.create(
        VOLUME_SNAPSHOT_CONTENTS,
        {
            "metadata": {"name": name},
            "spec": {
                "driver": DRIVER,
                "deletionPolicy": "Retain",
                "source": {"snapshotHandle": snap.snapshot_id},
                "volumeSnapshotRef": {"name": "restored-backup", "namespace": "default"},
            },
        },
    )
    try:

        async def label() -> str:
            content = await api.get(VOLUME_SNAPSHOT_CONTENTS, name)
            return str((content["metadata"].get("labels") or {}).get(MANAGED_BY, ""))

        assert await eventually_async("the content labelled", label, 30) == a.name
    finally:
        await api.delete(VOLUME_SNAPSHOT_CONTENTS, name)


# --- who may pull ------------------------------------------------------------------------------------


async def test_a_peer_that_is_not_a_node_plugin_of_this_driver_is_refused(
    cluster: TransferCluster, api: ApiClient
) -> None:
    a, b = await start(cluster, 2)
    ca = Client(a.driver.endpoint)
    try:
        vol = made_volume(ca, "guarded", 32 * MiB)
    finally:
        ca.close()
    secret = await cluster.tls_secret()
    ca_file = b.driver.root / "ca.crt"
    ca_file.write_bytes(secret["ca.crt"])
    trusted = ssl.create_default_context(cafile=str(ca_file))
    endpoint = (a.ip, cluster.port)

    async def ask(token: str, node: str, volume_id: str = vol.volume_id) -> object:
        return await transfer_client.describe(
            endpoint, trusted, SERVER_NAME, token, node, "volume", volume_id
        )

    b_token = b.token_file.read_text()
    assert await ask(b_token, b.name) is not None  # the peer itself is served
    # Another node named than the one its token is bound to.
    with pytest.raises(TransferDenied):
        await ask(b_token, a.name)
    # Another ServiceAccount's token, bound to a pod on a node all the same.
    account = f"intruder-{cluster.suffix}"
    await api.create(SERVICE_ACCOUNTS, {"metadata": {"name": account, "namespace": NAMESPACE}}, NAMESPACE)
    intruder = await plugin_pod(api, account, b.name, "127.0.0.9", account=account)
    try:
        with pytest.raises(TransferDenied, match="is not a node plugin of this driver"):
            await ask(await token_for(api, account, AUDIENCE, intruder), b.name)
    finally:
        await force_delete_pod(api, intruder["name"], NAMESPACE)
        await api.delete(SERVICE_ACCOUNTS, account, NAMESPACE)
    # The plugin's account, but a token bound to no pod (so to no node).
    with pytest.raises(TransferDenied, match="not bound to a pod"):
        await ask(await token_for(api, PLUGIN_ACCOUNT, AUDIENCE, None), b.name)
    # A token for another audience (the API server's own).
    with pytest.raises(TransferDenied):
        await ask(await token_for(api, PLUGIN_ACCOUNT, "https://kubernetes.default.svc", b.pod), b.name)
    with pytest.raises(TransferDenied):
        await ask("not-a-token", b.name)
    # Ids that are paths, and ids no pool holds.
    with pytest.raises(BadRequest):
        await ask(b_token, b.name, "../../etc/passwd")
    assert await ask(b_token, b.name, "vol-unknown") is None
    # A client that does not trust the transfers' CA never gets as far as sending its token.
    with pytest.raises(TransferError, match="CERTIFICATE_VERIFY_FAILED"):
        await transfer_client.describe(
            endpoint, ssl.create_default_context(), SERVER_NAME, b_token, b.name, "volume", vol.volume_id
        )


# --- moves --------------------------------------------------------------------------------------------


async def make_pv(api: ApiClient, name: str, handle: str, node: str, size: int) -> None:
    await api.create(
        PERSISTENT_VOLUMES,
        {
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": str(size)},
                "accessModes": ["ReadWriteOnce"],
                "volumeMode": "Block",
                "persistentVolumeReclaimPolicy": "Retain",
                "csi": {"driver": DRIVER, "volumeHandle": handle},
                "nodeAffinity": node_affinity(TOPOLOGY, node),
            },
        },
    )


async def placed_volume(
    api: ApiClient, node: ClusterNode, pv_name: str, size: int, blocks: int
) -> tuple[str, str]:
    """A block volume made on `node` with `blocks` MiB of data, and its PV: (handle, data digest)."""
    client = Client(node.driver.endpoint)
    try:
        handle = made_volume(client, pv_name, size).volume_id
    finally:
        client.close()
    write_scattered(volume_file(node, handle), blocks)
    await make_pv(api, pv_name, handle, node.name, size)
    return handle, file_digest(volume_file(node, handle))


def records(node: ClusterNode) -> set[str]:
    directory = node.driver.state / "volumes"
    return {p.stem for p in directory.glob("*.json")} if directory.exists() else set()


def pool_files(node: ClusterNode) -> list[str]:
    return sorted(p.name for p in (node.driver.pool / "volumes").iterdir())


async def converged(
    api: ApiClient, pv_name: str, source: ClusterNode, target: ClusterNode, handle: str, digest: str
) -> None:
    """Exactly one copy, on the target, with the data, and nothing left of the move."""

    async def done() -> list[str]:
        pv = await api.get(PERSISTENT_VOLUMES, pv_name)
        problems = []
        if affinity_node(pv, TOPOLOGY) != target.name:  # type: ignore[arg-type]
            problems.append(f"the PV points at {affinity_node(pv, TOPOLOGY)}")  # type: ignore[arg-type]
        md = pv["metadata"]
        if {TO_LABEL, FROM_LABEL} & (md.get("labels") or {}).keys() or any(
            k.startswith(PREFIX) for k in md.get("annotations") or {}
        ):
            problems.append(f"the move's marks are still there: {md.get('labels')} {md.get('annotations')}")
        if pool_files(source) or handle in records(source):
            problems.append(f"the source still has {pool_files(source)} {records(source)}")
        if pool_files(target) != [f"{handle}.img"]:
            problems.append(f"the target's pool holds {pool_files(target)}")
        return problems

    await eventually_async("the move converged", done, 60, satisfied=lambda p: not p)
    assert file_digest(volume_file(target, handle)) == digest


STEPS = [
    (0, AFTER_RELEASE),
    (1, AFTER_PULL),
    (1, AFTER_SWITCH),
    (0, AFTER_DROP),
    (1, "mid-pull"),
    (0, "mid-serve"),
    (-1, "none"),
]


@pytest.mark.parametrize(("victim", "step"), STEPS, ids=[s for _, s in STEPS])
async def test_a_move_converges_to_one_copy_after_a_kill_at_any_step(
    cluster: TransferCluster, api: ApiClient, victim: int, step: str
) -> None:
    armed = {victim: step} if step.startswith("move-") else {}
    a, b = await start(cluster, 2, armed)
    pv_name = f"pv-move-{cluster.suffix}"
    handle, digest = await placed_volume(api, a, pv_name, 256 * MiB, 64)
    try:
        await ask_for_move(api, await api.get(PERSISTENT_VOLUMES, pv_name), b.name)  # type: ignore[arg-type]
        nodes = (a, b)
        if step.startswith("move-"):
            killed = nodes[victim]
            eventually(f"{killed.name} killed at {step}", lambda: killed.driver.proc.poll() == -9, 60)  # type: ignore[union-attr]
            cluster.restart(killed)
        elif step in ("mid-pull", "mid-serve"):
            part = volume_file(b, handle).with_name(f"{handle}.img.part")
            eventually("the pull under way", part.exists, 60, interval=0.002)
            # The target's pull is cut (mid-serve) or gone (mid-pull); either resumes.
            nodes[victim].driver.kill9()
            cluster.restart(nodes[victim])
        await converged(api, pv_name, a, b, handle, digest)
    finally:
        await api.delete(PERSISTENT_VOLUMES, pv_name)


async def test_kubectl_kubeloop_move_refuses_what_it_cannot_move_and_survives_its_own_kill(
    cluster: TransferCluster, api: ApiClient, control_plane: ControlPlane, namespace: str
) -> None:
    a, b = await start(cluster, 2)
    pv_name = f"pv-cli-{cluster.suffix}"
    handle, digest = await placed_volume(api, a, pv_name, 64 * MiB, 8)
    claim = await api.create(
        PERSISTENT_VOLUME_CLAIMS,
        {
            "metadata": {"name": "data", "namespace": namespace},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "volumeMode": "Block",
                "resources": {"requests": {"storage": str(64 * MiB)}},
                "volumeName": pv_name,
                "storageClassName": "",
            },
        },
        namespace,
    )
    claim["status"] = {"phase": "Bound"}
    await api.update_status(PERSISTENT_VOLUME_CLAIMS, claim)
    pv = await api.get(PERSISTENT_VOLUMES, pv_name)
    pv["spec"]["claimRef"] = {"namespace": namespace, "name": "data", "uid": claim["metadata"]["uid"]}
    pv = await api.update(PERSISTENT_VOLUMES, pv)
    pv["status"] = {"phase": "Bound"}
    await api.update_status(PERSISTENT_VOLUMES, pv)

    def cli(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "kubectl_kubeloop.main", f"--kubeconfig={control_plane.admin_kubeconfig}",
             *args],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def run(*args: str) -> tuple[int, str]:
        proc = cli(*args)
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, out

    try:
        code, out = run("move", "pvc", "data", "-n", namespace, "--to", "no-such-node")
        assert code == 1 and "node no-such-node does not exist" in out, out
        await api.create(
            PODS,
            {
                "metadata": {"name": "user", "namespace": namespace},
                "spec": {
                    "nodeName": a.name,
                    "containers": [{"name": "c", "image": "busybox"}],
                    "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "data"}}],
                },
            },
            namespace,
        )
        code, out = run("move", "pvc", "data", "-n", namespace, "--to", b.name)
        assert code == 1 and f"used by pod(s) {namespace}/user" in out, out
        await force_delete_pod(api, "user", namespace)
        await eventually_async("the pod gone", lambda: _gone(api, namespace, "user"), 30)

        # The command killed right after it asked: the plugins finish the move all the same.
        proc = cli("move", "pvc", "data", "-n", namespace, "--to", b.name)
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert f"moving from node {a.name} to node {b.name}" in first, first
        proc.kill()
        proc.wait()
        await converged(api, pv_name, a, b, handle, digest)
        # Run again, it reports the volume is there already.
        code, out = run("move", "pvc", "data", "-n", namespace, "--to", b.name)
        assert code == 0 and f"already on node {b.name}" in out, out

        # Cancelled before it switched: the target (a, now) is down, so it cannot pull; the source
        # keeps its copy, released again.
        a.driver.stop()
        proc = cli("move", "pvc", "data", "-n", namespace, "--to", a.name, "--timeout", "3s")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1 and "the move goes on without this command" in out, out
        code, out = run("move", "pvc", "data", "-n", namespace, "--cancel")
        assert code == 0 and "cancelled" in out, out
        cluster.restart(a)
        await eventually_async(
            "the cancelled move forgotten",
            lambda: _released(b, handle),
            30,
        )
        assert file_digest(volume_file(b, handle)) == digest
        assert pool_files(a) == []
    finally:
        await api.delete(PERSISTENT_VOLUME_CLAIMS, "data", namespace)
        await api.delete(PERSISTENT_VOLUMES, pv_name)


async def _gone(api: ApiClient, namespace: str, name: str) -> bool:
    try:
        await api.get(PODS, name, namespace)
    except ApiError as e:
        return e.not_found
    return False


async def _released(node: ClusterNode, handle: str) -> bool:
    doc = json.loads((node.driver.state / "volumes" / f"{handle}.json").read_text())
    return bool(doc["leaving_to"] == "" and doc["move_pv"] == "")


async def test_a_plugin_restarted_without_transfers_releases_a_volume_a_move_left_released(
    cluster: TransferCluster, api: ApiClient
) -> None:
    a, b = await start(cluster, 2, {0: AFTER_RELEASE})
    pv_name = f"pv-off-{cluster.suffix}"
    handle, _ = await placed_volume(api, a, pv_name, 32 * MiB, 1)
    try:
        await ask_for_move(api, await api.get(PERSISTENT_VOLUMES, pv_name), b.name)  # type: ignore[arg-type]
        eventually("a killed after releasing", lambda: a.driver.proc.poll() == -9, 60)  # type: ignore[union-attr]
        assert record_of(a, handle)["leaving_to"] == b.name
        # Started again with transfers off: nothing would end the move, so the mark goes.
        a.driver.extra = [
            x for x in a.driver.extra if not x.startswith(("--transfer-", "--failpoints", "--kubeconfig"))
        ]
        a.driver.module = "csi_driver.main"
        a.driver.start()
        assert record_of(a, handle)["leaving_to"] == ""
    finally:
        await api.delete(PERSISTENT_VOLUMES, pv_name)


def record_of(node: ClusterNode, volume_id: str) -> dict[str, object]:
    doc: dict[str, object] = json.loads((node.driver.state / "volumes" / f"{volume_id}.json").read_text())
    return doc


async def test_a_half_made_pull_no_call_came_back_for_is_swept_once_it_is_old(tmp_path: Path) -> None:
    state = DriverState(tmp_path / "pool", tmp_path / "state")
    await state.load()
    controller = ControllerServer(
        state,
        ControllerConfig(
            max_volume_size=1 << 40,
            capacity=PoolCapacity(),
            node_local=True,
            local_node_id="n",
            transfers=True,
        ),
    )
    await controller.reconcile()
    try:
        for name, age in (("stale", PULL_KEPT_SECONDS + 60), ("recent", 60.0)):
            await state.put_volume(
                VolumeRecord(
                    volume_id=f"vol-{name}", name=name, capacity=MiB, seq=state.next_seq(),
                    access_type="block", fs_type="", source_kind="snapshot", source_id="snap-x",
                    source_node="elsewhere", created_at=time.time() - age,
                )
            )  # fmt: skip
            write_part(state.volume_file(f"vol-{name}"))
        await controller.sweep_stale_pulls()
        assert state.volume("vol-stale") is None and state.volume("vol-recent") is not None
        assert sorted(p.name for p in state.volumes_dir.iterdir()) == ["vol-recent.img.part"]
    finally:
        state.close()


def write_part(volume_file: str) -> None:
    """What a cut pull leaves beside the volume's file."""
    Path(volume_file + ".part").write_bytes(b"pulled so far")
