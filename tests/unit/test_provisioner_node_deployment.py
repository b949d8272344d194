"""Distributed provisioning's decisions, each against upstream external-provisioner's
(pkg/controller checkNode, becomeOwner's delay and VolumeIsAccessible, pkg/owner, the topology
table of its README, cmd/csi-provisioner's flags and getNameWithMaxLength): which node handles a
claim, which deletes a volume, how long a node waits before trying to own an Immediate claim, what
CreateVolume's accessibility requirements are with --strict-topology and --immediate-topology,
and the names and owners of the CSIStorageCapacity objects. The wait itself runs on the FakeClock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controller_runtime import storage
from controller_runtime.clock_testing import FakeClock
from controller_runtime.kinds import (
    CSINode,
    Node,
    PersistentVolume,
    PersistentVolumeClaim,
    StorageClass,
    as_obj,
    pv_view,
    pvc_view,
)
from controller_runtime.resources import Obj
from controller_runtime.store import Store
from external_provisioner import names, owner
from external_provisioner.capacity import owned_by
from external_provisioner.decide import NodeCheck, node_check, volume_accessible
from external_provisioner.main import build_parser
from external_provisioner.node_deployment import (
    ClaimChanged,
    NodeDeployment,
    OwnerDelays,
    OwnerElection,
    Ownership,
    RequestShape,
)
from external_provisioner.request import ProvisionError, accessibility

DRIVER = "loop.csi.kubeloop.dev"
KEY = "topology.loop.csi.kubeloop.dev/node"
ACCESSIBILITY = "error generating accessibility requirements: "


def claim(selected: str = "", **meta: Any) -> PersistentVolumeClaim:
    annotations = {storage.ANN_SELECTED_NODE: selected} if selected else {}
    return pvc_view(
        {
            "metadata": {
                "name": "data",
                "namespace": "ns",
                "uid": "u-1",
                "resourceVersion": "5",
                "annotations": annotations,
                **meta,
            },
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
        }
    )


IMMEDIATE: StorageClass = {
    "metadata": {"name": "now"},
    "provisioner": DRIVER,
    "volumeBindingMode": "Immediate",
}
WFFC: StorageClass = {
    "metadata": {"name": "late"},
    "provisioner": DRIVER,
    "volumeBindingMode": "WaitForFirstConsumer",
}


# -- which node handles a claim ---------------------------------------------------------------------


def test_a_claim_selected_for_this_node_is_provisioned_and_for_another_ignored() -> None:
    for cls in (IMMEDIATE, WFFC):
        assert (
            node_check(claim("n1"), cls, "n1", immediate_binding=True, allowed_here=True)
            is NodeCheck.PROVISION
        )
        assert (
            node_check(claim("n2"), cls, "n1", immediate_binding=True, allowed_here=True) is NodeCheck.IGNORE
        )


def test_an_unselected_claim_is_elected_only_when_immediate_allowed_and_enabled() -> None:
    check = node_check(claim(), IMMEDIATE, "n1", immediate_binding=True, allowed_here=True)
    assert check is NodeCheck.ELECT
    # A class without a binding mode is Immediate (the API's default).
    unset: StorageClass = {"metadata": {"name": "x"}, "provisioner": DRIVER}
    assert node_check(claim(), unset, "n1", immediate_binding=True, allowed_here=True) is NodeCheck.ELECT
    # The scheduler picks for WaitForFirstConsumer; --node-deployment-immediate-binding=false
    # leaves Immediate claims to a controller of the admin's; allowedTopologies may exclude us.
    assert node_check(claim(), WFFC, "n1", immediate_binding=True, allowed_here=True) is NodeCheck.IGNORE
    assert (
        node_check(claim(), IMMEDIATE, "n1", immediate_binding=False, allowed_here=True) is NodeCheck.IGNORE
    )
    assert (
        node_check(claim(), IMMEDIATE, "n1", immediate_binding=True, allowed_here=False) is NodeCheck.IGNORE
    )


# -- which node deletes a volume --------------------------------------------------------------------


def pv_with(*terms: list[Obj]) -> PersistentVolume:
    return pv_view(
        {
            "metadata": {"name": "pv"},
            "spec": {
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": t} for t in terms]}}
            },
        }
    )


def test_a_volume_belongs_to_the_node_whose_topology_satisfies_its_affinity() -> None:
    here = {KEY: "n1"}
    assert volume_accessible(pv_with([{"key": KEY, "operator": "In", "values": ["n1"]}]), here)
    assert not volume_accessible(pv_with([{"key": KEY, "operator": "In", "values": ["n2"]}]), here)
    # Terms are ORed, expressions ANDed.
    either = pv_with(
        [{"key": KEY, "operator": "In", "values": ["n2"]}], [{"key": KEY, "operator": "In", "values": ["n1"]}]
    )
    assert volume_accessible(either, here)
    both = pv_with([{"key": KEY, "operator": "In", "values": ["n1"]}, {"key": "zone", "operator": "Exists"}])
    assert not volume_accessible(both, here)
    assert volume_accessible(pv_with([{"key": KEY, "operator": "NotIn", "values": ["n2"]}]), here)
    assert volume_accessible(pv_with([{"key": "zone", "operator": "DoesNotExist"}]), here)
    assert volume_accessible(pv_with([{"key": "rank", "operator": "Gt", "values": ["3"]}]), {"rank": "4"})
    assert not volume_accessible(pv_with([{"key": "rank", "operator": "Lt", "values": ["3"]}]), {"rank": "4"})
    # matchFields cannot match a node known by its labels alone.
    fields: PersistentVolume = {
        "metadata": {"name": "pv"},
        "spec": {
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
                    ]
                }
            }
        },
    }
    assert not volume_accessible(fields, here)


def test_without_affinity_or_node_topology_every_node_may_delete() -> None:
    """Upstream's VolumeIsAccessible: no affinity, or a driver reporting no topology."""
    assert volume_accessible({"metadata": {"name": "pv"}, "spec": {}}, {KEY: "n1"})
    assert volume_accessible(pv_with([{"key": KEY, "operator": "In", "values": ["n2"]}]), {})


# -- the wait before owning an Immediate claim -------------------------------------------------------


def test_the_first_wait_is_up_to_the_base_delay_and_later_ones_grow_to_the_max() -> None:
    delays = OwnerDelays(20.0, 60.0, rand=lambda: 0.25)
    assert [delays.when("u") for _ in range(4)] == [15.0, 35.0, 55.0, 55.0]
    assert delays.attempts("u") == 4
    delays.forget("u")
    assert delays.when("u") == 15.0
    # The jitter never makes a wait negative.
    assert OwnerDelays(20.0, 60.0, rand=lambda: 0.999).when("v") == pytest.approx(0.02)


def waiting_election(store: Store, clock: FakeClock, base: float, maximum: float) -> OwnerElection:
    """An election whose waits are all this test reaches: no API write, no GetCapacity (the
    claim is taken or replaced first), and no jitter."""
    node = NodeDeployment("n1", "n1", {KEY: "n1"}, base_delay=base, max_delay=maximum)
    nothing: Any = None
    return OwnerElection(node, nothing, nothing, store, clock, RequestShape("", True), rand=lambda: 0.0)


async def test_the_wait_ends_early_when_another_node_took_the_claim() -> None:
    clock = FakeClock()
    store = Store()
    store.upsert(as_obj(claim()))
    election = waiting_election(store, clock, 20.0, 60.0)
    task = asyncio.create_task(election.become_owner(claim(), IMMEDIATE, "pvc-u-1", None))
    await clock.until_waiting()
    assert clock.waiting() == [pytest.approx(0.2)]  # a look at the cache every base/100
    await clock.advance(1.0)
    assert not task.done()
    store.upsert(as_obj(claim("n2", resourceVersion="6")))
    await clock.advance(0.2)
    assert await task is Ownership.TAKEN
    assert election.delays.attempts("u-1") == 0  # forgotten: a reschedule starts from the base delay
    assert clock.monotonic() < 1000.0 + 20.0


async def test_a_claim_that_went_away_ends_the_wait_with_an_error() -> None:
    clock = FakeClock()
    store = Store()
    store.upsert(as_obj(claim()))
    election = waiting_election(store, clock, 1.0, 2.0)
    task = asyncio.create_task(election.become_owner(claim(), IMMEDIATE, "pvc-u-1", None))
    await clock.until_waiting()
    store.upsert(as_obj(claim(uid="u-2")))  # deleted and created again under the same name
    await clock.advance(0.01)
    with pytest.raises(ClaimChanged, match="PVC was replaced"):
        await task


# -- accessibility requirements: --strict-topology and --immediate-topology ------------------------


def node(name: str) -> Node:
    return {"metadata": {"name": name, "labels": {KEY: name}}}


def csinode(name: str) -> CSINode:
    return {"metadata": {"name": name}, "spec": {"drivers": [{"name": DRIVER, "topologyKeys": [KEY]}]}}


NODES = {n: node(n) for n in ("n1", "n2", "n3")}
CSINODES = [csinode(n) for n in NODES]


def allowed(*values: str) -> StorageClass:
    return {"allowedTopologies": [{"matchLabelExpressions": [{"key": KEY, "values": list(values)}]}]}


def test_strict_topology_asks_for_the_selected_node_alone() -> None:
    topo = accessibility(DRIVER, {}, "pvc-x", NODES["n2"], CSINODES, NODES, strict=True)
    assert topo is not None and topo.requisite == topo.preferred == [{KEY: "n2"}]
    topo = accessibility(DRIVER, allowed("n1", "n2"), "pvc-x", NODES["n2"], CSINODES, NODES, strict=True)
    assert topo is not None and topo.requisite == [{KEY: "n2"}]
    with pytest.raises(ProvisionError) as err:
        accessibility(DRIVER, allowed("n1", "n3"), "pvc-x", NODES["n2"], CSINODES, NODES, strict=True)
    assert str(err.value) == (
        f"{ACCESSIBILITY}selected node '\"n2\"' topology '[{{{KEY} n2}}]' is not in allowed topologies: "
        f"[[{{{KEY} n1}}] [{{{KEY} n3}}]]"
    )


def test_strict_topology_changes_nothing_without_a_selected_node() -> None:
    loose = accessibility(DRIVER, {}, "pvc-x", None, CSINODES, NODES)
    assert accessibility(DRIVER, {}, "pvc-x", None, CSINODES, NODES, strict=True) == loose


def test_immediate_topology_false_sends_no_requirement_unless_the_class_limits_it() -> None:
    assert accessibility(DRIVER, {}, "pvc-x", None, CSINODES, NODES, immediate=False) is None
    topo = accessibility(DRIVER, allowed("n3"), "pvc-x", None, CSINODES, NODES, immediate=False)
    assert topo is not None and topo.requisite == [{KEY: "n3"}]
    # A selected node is unaffected: that is late binding.
    topo = accessibility(DRIVER, {}, "pvc-x", NODES["n1"], CSINODES, NODES, immediate=False)
    assert topo is not None and topo.preferred[0] == {KEY: "n1"}


def test_a_node_deployment_sees_its_own_node_only() -> None:
    """Upstream's fixed CSINode and Node from NodeGetInfo: requisite is this node's segment."""
    here = NodeDeployment("n1", "id-1", {KEY: "n1"})
    local_csinode, local_node = here.local_objects(DRIVER)
    assert local_csinode["spec"]["drivers"] == [{"name": DRIVER, "nodeID": "id-1", "topologyKeys": [KEY]}]
    topo = accessibility(DRIVER, {}, "pvc-x", local_node, [local_csinode], {"n1": local_node})
    assert topo is not None and topo.requisite == topo.preferred == [{KEY: "n1"}]


# -- capacity objects: managed-by and owner ---------------------------------------------------------


def test_managed_by_names_the_node_within_a_dns_label() -> None:
    assert names.capacity_managed_by(None) == "external-provisioner"
    assert names.capacity_managed_by("worker-1") == "external-provisioner-worker-1"
    long_node = "n" * 50
    managed = names.capacity_managed_by(long_node)
    assert len(managed) <= 63 and managed.endswith(long_node)
    assert managed == f"ext-{names._fnv32a('external-provisioner')}-{long_node}"
    too_long = "x" * 70
    assert names.capacity_managed_by(too_long) == (
        f"external-provisioner-{names._fnv32a('external-provisioner-' + too_long)}"
    )


def test_fnv32a_is_the_go_hash() -> None:
    # hash/fnv New32a of "" and "a", as Go computes them.
    assert names._fnv32a("") == "811c9dc5"
    assert names._fnv32a("a") == "e40c292c"


def test_owner_references_and_the_controlling_owner() -> None:
    ref = owner.reference("apps/v1", "DaemonSet", "kubeloop-csi-node", "uid-ds")
    assert ref == {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "name": "kubeloop-csi-node",
        "uid": "uid-ds",
        "controller": True,
    }
    pod = {"metadata": {"ownerReferences": [{"kind": "Other", "uid": "x"}, {**ref, "controller": True}]}}
    assert owner.controller_of(pod) == ref
    assert owner.controller_of({"metadata": {"ownerReferences": [{"kind": "Other", "uid": "x"}]}}) is None
    assert owned_by({"metadata": {"ownerReferences": [ref]}}, ref)
    assert not owned_by({"metadata": {"ownerReferences": [{**ref, "controller": False}]}}, ref)
    assert not owned_by({"metadata": {}}, ref)


# -- flags ------------------------------------------------------------------------------------------


def test_node_deployment_flags_take_upstream_names_defaults_and_go_bools() -> None:
    args = build_parser().parse_args([])
    assert (args.node_deployment, args.node_deployment_immediate_binding) == (False, True)
    assert (args.node_deployment_base_delay, args.node_deployment_max_delay) == (20.0, 60.0)
    assert (args.strict_topology, args.immediate_topology, args.capacity_ownerref_level) == (False, True, 1)
    args = build_parser().parse_args(
        [
            "--node-deployment",
            "--strict-topology=true",
            "--immediate-topology=false",
            "--node-deployment-immediate-binding=false",
            "--node-deployment-base-delay=500ms",
            "--node-deployment-max-delay=2s",
            "--enable-capacity=true",
            "--capacity-ownerref-level=-1",
        ]
    )
    assert (args.node_deployment, args.strict_topology, args.immediate_topology) == (True, True, False)
    assert (args.node_deployment_immediate_binding, args.enable_capacity) == (False, True)
    assert (args.node_deployment_base_delay, args.node_deployment_max_delay) == (0.5, 2.0)
    assert args.capacity_ownerref_level == -1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--strict-topology=maybe"])
