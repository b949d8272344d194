"""external-provisioner's pure translation: parameters and secrets, access modes, topology,
the CreateVolume request, the PV, quantities and error texts; and the intent journal on disk."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from controller_runtime import storage
from controller_runtime.csi_client import error_text
from controller_runtime.files import temp_name
from controller_runtime.kinds import (
    CSINode,
    Node,
    PersistentVolumeClaim,
    StorageClass,
    TopologySelectorTerm,
    csi_node_view,
    node_view,
    pvc_view,
)
from controller_runtime.quantity import format_quantity
from external_provisioner import names
from external_provisioner.journal import LOG_NAME, Entry, Journal
from external_provisioner.request import (
    CreatedVolume,
    ProvisionError,
    SecretRef,
    Topology,
    VolumeSpec,
    accessibility,
    allowed_segments,
    build_pv,
    csi_access_mode,
    node_affinity,
    split_parameters,
    volume_spec,
)
from kubeloop_grpc.csi import csi_pb2

Mode = csi_pb2.VolumeCapability.AccessMode.Mode
DRIVER = "loop.csi.kubeloop.dev"
KEY = "topology.loop.csi.kubeloop.dev/node"
ACCESSIBILITY = "error generating accessibility requirements: "  # the Go sidecar's prefix


def claim(**spec: object) -> PersistentVolumeClaim:
    return pvc_view(
        {
            "metadata": {
                "name": "data",
                "namespace": "ns",
                "uid": "u-1",
                "resourceVersion": "7",
                "annotations": {"team": "a"},
            },
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}},
                "storageClassName": "fast",
                **spec,
            },
        }
    )


def node(name: str) -> Node:
    return node_view({"metadata": {"name": name, "labels": {KEY: name}}})


def csinode(name: str, keys: list[str] | None = None) -> CSINode:
    return csi_node_view(
        {
            "metadata": {"name": name},
            "spec": {"drivers": [{"name": DRIVER, "nodeID": name, "topologyKeys": keys or [KEY]}]},
        }
    )


def test_reserved_parameters_are_stripped_and_secrets_resolved() -> None:
    params = {
        "csi.storage.k8s.io/fstype": "xfs",
        "csi.storage.k8s.io/provisioner-secret-name": "prov-${pvc.name}",
        "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}",
        "csi.storage.k8s.io/node-stage-secret-name": "${pvc.annotations['team']}-stage",
        "csi.storage.k8s.io/node-stage-secret-namespace": "secrets",
        "speed": "fast",
    }
    out = split_parameters(params, claim(), "pvc-u-1", "ext4")
    assert out.driver == {"speed": "fast"}
    assert out.fs_type == "xfs"
    assert out.secrets["provisioner"] == SecretRef("prov-data", "ns")
    assert out.secrets["node-stage"] == SecretRef("a-stage", "secrets")
    assert split_parameters({}, claim(), "pvc-u-1", "ext4").fs_type == "ext4"


@pytest.mark.parametrize(
    "params",
    [
        {"csi.storage.k8s.io/unknown": "x"},
        {"csi.storage.k8s.io/provisioner-secret-name": "only-name"},
        # The namespace may not depend on what the claim's author writes.
        {
            "csi.storage.k8s.io/provisioner-secret-name": "s",
            "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.name}",
        },
    ],
)
def test_bad_parameters_are_final_errors(params: dict[str, str]) -> None:
    with pytest.raises(ProvisionError) as err:
        split_parameters(params, claim(), "pvc-u-1", "")
    assert err.value.final


def test_access_modes_depend_on_single_node_multi_writer() -> None:
    assert csi_access_mode("ReadWriteOnce", True) == Mode.SINGLE_NODE_MULTI_WRITER
    assert csi_access_mode("ReadWriteOncePod", True) == Mode.SINGLE_NODE_SINGLE_WRITER
    assert csi_access_mode("ReadWriteOnce", False) == Mode.SINGLE_NODE_WRITER
    assert csi_access_mode("ReadWriteMany", False) == Mode.MULTI_NODE_MULTI_WRITER
    assert csi_access_mode("ReadOnlyMany", True) == Mode.MULTI_NODE_READER_ONLY


def test_request_for_mount_and_block() -> None:
    sc: StorageClass = {"metadata": {"name": "fast"}, "mountOptions": ["noatime"]}
    params = split_parameters({"csi.storage.k8s.io/fstype": "ext3", "a": "b"}, claim(), "pvc-u-1", "")
    spec = volume_spec(claim(), sc, params, "pvc-u-1", extra_metadata=True, multi_writer=True, topology=None)
    req = spec.to_request({"token": "s"})
    assert req.name == "pvc-u-1" and req.capacity_range.required_bytes == 1 << 30
    assert req.parameters == {
        "a": "b",
        names.PARAM_PVC_NAME: "data",
        names.PARAM_PVC_NAMESPACE: "ns",
        names.PARAM_PV_NAME: "pvc-u-1",
    }
    (cap,) = req.volume_capabilities
    assert cap.mount.fs_type == "ext3" and list(cap.mount.mount_flags) == ["noatime"]
    assert dict(req.secrets) == {"token": "s"}
    block = volume_spec(
        claim(volumeMode="Block"),
        sc,
        params,
        "pvc-u-1",
        extra_metadata=False,
        multi_writer=False,
        topology=None,
    )
    (bcap,) = block.to_request().volume_capabilities
    assert bcap.HasField("block") and block.fs_type == "" and block.mount_flags == []


def test_spec_round_trips_through_json() -> None:
    spec = VolumeSpec(
        name="pvc-u-1",
        capacity=5,
        block=False,
        fs_type="ext4",
        mount_flags=["ro"],
        access_modes=["ReadWriteOnce"],
        parameters={"a": "b"},
        secret=SecretRef("s", "ns"),
        topology=Topology([{KEY: "n1"}], [{KEY: "n1"}]),
        source_volume="vol-1",
    )
    assert VolumeSpec.from_json(spec.to_json()) == spec
    assert spec.to_request().volume_content_source.volume.volume_id == "vol-1"


def test_topology_prefers_the_selected_node() -> None:
    nodes = {n: node(n) for n in ("n1", "n2", "n3")}
    topo = accessibility(DRIVER, {}, "pvc-x", nodes["n2"], [csinode(n) for n in nodes], nodes)
    assert topo is not None
    assert topo.preferred[0] == {KEY: "n2"}
    assert sorted(s[KEY] for s in topo.requisite) == ["n1", "n2", "n3"]


def test_topology_without_selected_node_spreads_and_respects_allowed_topologies() -> None:
    nodes = {n: node(n) for n in ("n1", "n2", "n3")}
    firsts = {
        accessibility(DRIVER, {}, f"pvc-{i}", None, [csinode(n) for n in nodes], nodes).preferred[0][KEY]  # type: ignore[union-attr]
        for i in range(30)
    }
    assert len(firsts) > 1  # rotated by volume name
    allowed: StorageClass = {
        "allowedTopologies": [{"matchLabelExpressions": [{"key": KEY, "values": ["n3", "n1"]}]}]
    }
    topo = accessibility(DRIVER, allowed, "pvc-x", None, [csinode(n) for n in nodes], nodes)
    assert topo is not None and sorted(s[KEY] for s in topo.requisite) == ["n1", "n3"]
    assert accessibility(DRIVER, {}, "pvc-x", None, [], {}) is None


def test_topology_errors_for_a_selected_node_without_the_driver() -> None:
    # No CSINode at all: the scheduler is asked for another node, as upstream does.
    with pytest.raises(ProvisionError) as err:
        accessibility(DRIVER, {}, "pvc-x", node("n1"), [], {"n1": node("n1")})
    assert err.value.reschedule
    assert str(err.value) == 'failed to get selected CSINode n1: csinode.storage.k8s.io "n1" not found'
    # A CSINode without the driver, or the driver without topology keys: an error, no reschedule.
    other: CSINode = {"metadata": {"name": "n1"}, "spec": {"drivers": [{"name": "other.example.com"}]}}
    keyless: CSINode = {"metadata": {"name": "n1"}, "spec": {"drivers": [{"name": DRIVER, "nodeID": "n1"}]}}
    for found in (other, keyless):
        with pytest.raises(ProvisionError) as err:
            accessibility(DRIVER, {}, "pvc-x", node("n1"), [found], {"n1": node("n1")})
        assert not err.value.reschedule
        assert str(err.value) == f"{ACCESSIBILITY}no topology key found for node n1"
    # The node lacks a label its CSINode names as a topology key.
    with pytest.raises(ProvisionError) as err:
        accessibility(DRIVER, {}, "pvc-x", node("n1"), [csinode("n1", [KEY, "zone"])], {"n1": node("n1")})
    assert str(err.value) == (
        f"{ACCESSIBILITY}topology labels from selected node "
        f"map[{KEY}:n1] does not match topology keys from CSINode [{KEY} zone]"
    )


def test_a_selected_node_outside_allowed_topologies_is_refused_not_requested() -> None:
    """The selected-node annotation is the claim author's to write: a node outside the class's
    allowedTopologies must never become the requisite segment (the Go sidecar refuses with this
    message; kubeloop sent that node's segment as the only requisite one, so the volume was made
    where the admin had not allowed it)."""
    nodes = {n: node(n) for n in ("n1", "n2", "n3")}
    allowed: StorageClass = {
        "allowedTopologies": [{"matchLabelExpressions": [{"key": KEY, "values": ["n3", "n1"]}]}]
    }
    with pytest.raises(ProvisionError) as err:
        accessibility(DRIVER, allowed, "pvc-x", nodes["n2"], [csinode(n) for n in nodes], nodes)
    assert not err.value.reschedule
    assert str(err.value) == (
        f'{ACCESSIBILITY}topology [{{{KEY} n2}}] from selected node "n2" is not in requisite: '
        f"[[{{{KEY} n1}}] [{{{KEY} n3}}]]"
    )
    # A node inside them: the requisite stays what the class allows, the node's segment is
    # preferred first and the rest follow in rotation, as upstream.
    topo = accessibility(DRIVER, allowed, "pvc-x", nodes["n3"], [csinode(n) for n in nodes], nodes)
    assert topo is not None
    assert topo.requisite == [{KEY: "n1"}, {KEY: "n3"}]
    assert topo.preferred == [{KEY: "n3"}, {KEY: "n1"}]
    # A term coarser than the node's segment covers it.
    zoned: Node = {**nodes["n1"], "metadata": {"name": "n1", "labels": {KEY: "n1", "zone": "a"}}}
    coarse: StorageClass = {
        "allowedTopologies": [{"matchLabelExpressions": [{"key": "zone", "values": ["a"]}]}]
    }
    topo = accessibility(DRIVER, coarse, "pvc-x", zoned, [csinode("n1", [KEY, "zone"])], {"n1": zoned})
    assert topo is not None and topo.requisite == [{"zone": "a"}] and topo.preferred == [{"zone": "a"}]


def test_allowed_topologies_with_many_values_stay_cheap() -> None:
    """The product of a class's expressions was deduplicated with a list membership test:
    quadratic, on the event loop, for every claim of the class (40,000 segments took a minute)."""
    values = [f"v{i}" for i in range(200)]
    terms: list[TopologySelectorTerm] = [
        {"matchLabelExpressions": [{"key": "a", "values": values}, {"key": "b", "values": values}]}
    ]
    start = time.monotonic()
    segments = allowed_segments(terms + terms)  # the second term repeats the first
    assert len(segments) == 200 * 200
    assert time.monotonic() - start < 5


def test_allowed_segments_are_the_product_of_expressions() -> None:
    terms: list[TopologySelectorTerm] = [
        {"matchLabelExpressions": [{"key": "zone", "values": ["a", "b"]}, {"key": "rack", "values": ["1"]}]}
    ]
    assert allowed_segments(terms) == [{"zone": "a", "rack": "1"}, {"zone": "b", "rack": "1"}]


def test_pv_is_pre_bound_with_finalizer_affinity_and_identity() -> None:
    sc: StorageClass = {"metadata": {"name": "fast"}, "reclaimPolicy": "Delete", "mountOptions": ["noatime"]}
    c = claim()
    params = split_parameters({"csi.storage.k8s.io/fstype": "ext4"}, c, "pvc-u-1", "")
    spec = volume_spec(c, sc, params, "pvc-u-1", extra_metadata=False, multi_writer=True, topology=None)
    created = CreatedVolume("vol-9", 1 << 30, {"fsType": "ext4"}, [{KEY: "n1"}])
    pv = build_pv(
        driver=DRIVER, identity="1-2-d", claim=c, storage_class=sc, spec=spec, params=params, created=created
    )
    assert pv["metadata"]["name"] == "pvc-u-1"
    assert pv["metadata"]["finalizers"] == [names.PV_FINALIZER]
    assert pv["metadata"]["annotations"] == {
        storage.ANN_PROVISIONED_BY: DRIVER,
        names.ANN_DELETION_SECRET_NAME: "",
        names.ANN_DELETION_SECRET_NAMESPACE: "",
    }
    s = pv["spec"]
    assert s["claimRef"] == {
        "kind": "PersistentVolumeClaim",
        "apiVersion": "v1",
        "namespace": "ns",
        "name": "data",
        "uid": "u-1",
        "resourceVersion": "7",
    }
    assert s["capacity"] == {"storage": "1Gi"} and s["storageClassName"] == "fast"
    assert s["csi"] == {
        "driver": DRIVER,
        "volumeHandle": "vol-9",
        "volumeAttributes": {"fsType": "ext4", names.PROVISIONER_IDENTITY: "1-2-d"},
        "fsType": "ext4",
    }
    assert s["nodeAffinity"] == node_affinity([{KEY: "n1"}])
    retain = build_pv(
        driver=DRIVER,
        identity="i",
        claim=c,
        storage_class={**sc, "reclaimPolicy": "Retain"},
        spec=spec,
        params=params,
        created=CreatedVolume("vol-9", 0),
    )
    assert "finalizers" not in retain["metadata"] and "nodeAffinity" not in retain["spec"]
    assert retain["spec"]["capacity"] == {"storage": "1Gi"}  # the request when the driver says 0


def test_quantities_and_error_texts() -> None:
    assert (
        format_quantity(1 << 30) == "1Gi"
        and format_quantity(3 * (1 << 20)) == "3Mi"
        and format_quantity(1000) == "1000"
    )
    assert format_quantity(0) == "0"

    class Err(grpc.aio.AioRpcError):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, None, None, "pool full")

    assert error_text(Err()) == "rpc error: code = ResourceExhausted desc = pool full"


async def test_journal_survives_a_new_process_and_refuses_an_entry_without_a_uid(tmp_path: Path) -> None:
    spec = VolumeSpec("pvc-u", 1, False, "ext4", [], ["ReadWriteOnce"], {})
    journal = Journal(tmp_path / "j")
    journal.load()
    await journal.put(Entry("u", "ns", "data", "fast", spec))
    half = Path(temp_name(tmp_path / "j" / LOG_NAME))
    await asyncio.to_thread(half.write_text, "{")  # a rewrite interrupted
    entry = journal.get("u")
    assert entry is not None
    entry.volume_id = "vol-1"
    await journal.put(entry)
    again = Journal(tmp_path / "j")
    (loaded,) = again.load()
    assert loaded == entry and not await asyncio.to_thread(half.exists)
    await again.remove("u")
    assert Journal(tmp_path / "j").load() == []
    with pytest.raises(ValueError):
        await again.put(Entry("", "ns", "d", "", spec))
