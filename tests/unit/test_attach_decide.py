"""The attach-detach controller's pure decision: detach before attach, Multi-Attach and its
messages, volumesInUse protection, forced detach (timeout, out-of-service, deleted nodes),
uncertain and pending attachments, node status lists, and the shared names."""

from __future__ import annotations

import hashlib

from controller_runtime.attach_rules import multi_attach_allowed
from controller_runtime.kinds import PersistentVolume, PodStatus, pv_view
from controller_runtime.volumes import (
    attacher_finalizer,
    csi_volume,
    pod_terminated,
    unique_volume_name,
    va_name,
)
from services.attach_detach.decide import (
    Attachment,
    DesiredVolume,
    NodeInfo,
    PodRef,
    decide,
    multi_attach_message,
    split_unique_name,
)
from services.attach_detach.desired_state import DesiredState

DRIVER = "loop.csi.kubeloop.dev"


def vol(handle: str = "vol-1", multi: bool = False) -> DesiredVolume:
    return DesiredVolume(f"pv-{handle}", DRIVER, handle, unique_volume_name(DRIVER, handle), multi)


UNIQUE = unique_volume_name(DRIVER, "vol-1")


def att(
    node: str,
    handle: str = "vol-1",
    attached: bool = True,
    deleting: bool = False,
    error: str = "",
    pending: bool = False,
) -> Attachment:
    return Attachment(
        va_name(handle, DRIVER, node),
        node,
        f"pv-{handle}",
        DRIVER,
        handle,
        unique_volume_name(DRIVER, handle),
        attached,
        deleting,
        error,
        pending,
    )


def node(
    name: str,
    in_use: tuple[str, ...] = (),
    ready: bool = True,
    attached: tuple[str, ...] = (),
    exists: bool = True,
    out_of_service: bool = False,
) -> NodeInfo:
    return NodeInfo(name, exists, ready, frozenset(in_use), attached, exists, out_of_service)


def run(desired: DesiredState, attachments: list[Attachment], nodes: list[NodeInfo], **kw: object):  # type: ignore[no-untyped-def]
    args = {
        "attach_required": lambda _d: True,
        "unmount_wait_since": {},
        "now": 100.0,
        "max_wait_for_unmount": 360.0,
    }
    args.update(kw)
    return decide(desired.entries(), attachments, {n.name: n for n in nodes}, **args)  # type: ignore[arg-type]


def test_names_follow_the_contract() -> None:
    digest = hashlib.sha256(f"vol-1{DRIVER}node-a".encode()).hexdigest()
    assert va_name("vol-1", DRIVER, "node-a") == f"csi-{digest}"
    assert unique_volume_name(DRIVER, "vol-1") == "kubernetes.io/csi/loop.csi.kubeloop.dev^vol-1"
    assert attacher_finalizer(DRIVER) == "external-attacher/loop-csi-kubeloop-dev"


def test_attach_wanted_volume_and_list_it_once_attached() -> None:
    ds = DesiredState()
    ds.set_pod(PodRef("ns", "p", "u1"), "node-a", [vol()])
    plan = run(ds, [], [node("node-a")])
    assert [e.va_name for e in plan.attaches] == [va_name("vol-1", DRIVER, "node-a")]
    plan = run(ds, [att("node-a")], [node("node-a")])
    assert not plan.attaches
    assert plan.node_status == {"node-a": (unique_volume_name(DRIVER, "vol-1"),)}


def test_no_attach_when_driver_needs_none() -> None:
    ds = DesiredState()
    ds.set_pod(PodRef("ns", "p", "u1"), "node-a", [vol()])
    assert not run(ds, [], [node("node-a")], attach_required=lambda _d: False).attaches


def test_exclusive_volume_attached_elsewhere_is_refused_naming_the_pods_there() -> None:
    ds = DesiredState()
    ds.set_pod(PodRef("ns", "a", "u1"), "node-a", [vol()])
    ds.set_pod(PodRef("ns", "b", "u2"), "node-b", [vol()])
    plan = run(ds, [att("node-a")], [node("node-a", in_use=(UNIQUE,)), node("node-b")])
    assert not plan.attaches
    assert [(m.other_nodes, m.other_pods) for m in plan.multi_attach] == [
        (("node-a",), (PodRef("ns", "a", "u1"),))
    ]


def test_exclusive_volume_held_by_no_known_pod_is_refused_without_names() -> None:
    ds = DesiredState()
    ds.set_pod(PodRef("ns", "b", "u2"), "node-b", [vol()])
    unique = (UNIQUE,)
    plan = run(ds, [att("node-a")], [node("node-a", in_use=unique), node("node-b")])
    assert [(m.other_nodes, m.other_pods) for m in plan.multi_attach] == [(("node-a",), ())]


def test_multi_attach_messages_name_only_pods_of_the_same_namespace() -> None:
    me = PodRef("ns", "me", "u0")
    prefix = 'Multi-Attach error for volume "pv-1" '
    assert multi_attach_message("pv-1", me, []) == (
        prefix + "Volume is already exclusively attached to one node and can't be attached to another"
    )
    local = [PodRef("ns", "web-1", "u1"), PodRef("ns", "web-0", "u2")]
    assert multi_attach_message("pv-1", me, local) == prefix + "Volume is already used by pod(s) web-0, web-1"
    foreign = [PodRef("other", "x", "u3"), PodRef("third", "y", "u4")]
    assert multi_attach_message("pv-1", me, local[:1] + foreign) == (
        prefix + "Volume is already used by pod(s) web-1 and 2 pod(s) in different namespaces"
    )
    assert multi_attach_message("pv-1", me, foreign) == (
        prefix + "Volume is already used by 2 pod(s) in different namespaces"
    )


def test_two_wishes_for_one_exclusive_volume_attach_only_one_and_the_other_waits() -> None:
    ds = DesiredState()
    ds.set_pod(PodRef("ns", "a", "u1"), "node-a", [vol()])
    ds.set_pod(PodRef("ns", "b", "u2"), "node-b", [vol()])
    plan = run(ds, [], [node("node-a"), node("node-b")])
    assert [e.node for e in plan.attaches] == ["node-a"]
    assert not plan.multi_attach, "an attach under way elsewhere is waited for silently"


def test_exclusive_volume_waits_silently_for_an_operation_elsewhere() -> None:
    ds = DesiredState()
    ds.set_pod(PodRef("ns", "b", "u2"), "node-b", [vol()])
    nodes = [node("node-a", in_use=(UNIQUE,)), node("node-b")]
    for busy in (att("node-a", attached=False, pending=True), att("node-a", deleting=True)):
        plan = run(ds, [busy], nodes)
        assert not plan.attaches and not plan.multi_attach
    # Detached by this very plan (the node no longer uses it): wait for the detach, no error.
    plan = run(ds, [att("node-a")], [node("node-a"), node("node-b")])
    assert [d.attachment.node for d in plan.detaches] == ["node-a"]
    assert not plan.attaches and not plan.multi_attach


def test_uncertain_attachment_elsewhere_blocks_nothing() -> None:
    ds = DesiredState()
    ds.set_pod(PodRef("ns", "a", "u1"), "node-a", [vol()])
    ds.set_pod(PodRef("ns", "b", "u2"), "node-b", [vol()])
    failed = att("node-a", attached=False, error="rpc error: code = Internal desc = boom")
    plan = run(ds, [failed], [node("node-a"), node("node-b")])
    assert [e.node for e in plan.attaches] == ["node-b"] and not plan.multi_attach
    assert plan.node_status == {}, "an uncertain attachment is not listed as attached"


def test_uncertain_attachment_no_pod_wants_is_detached_but_pending_one_is_not() -> None:
    failed = att("node-a", attached=False, error="boom")
    assert [d.attachment.name for d in run(DesiredState(), [failed], [node("node-a")]).detaches] == [
        failed.name
    ]
    pending = att("node-a", attached=False, pending=True)
    assert not run(DesiredState(), [pending], [node("node-a")]).detaches


def test_volume_without_access_modes_may_attach_to_several_nodes() -> None:
    assert multi_attach_allowed(())
    assert multi_attach_allowed(("ReadWriteOnce", "ReadOnlyMany"))
    assert multi_attach_allowed(("ReadWriteMany",))
    assert not multi_attach_allowed(("ReadWriteOnce",))
    assert not multi_attach_allowed(("ReadWriteOncePod",))


def test_unique_names_split_back_into_driver_and_handle() -> None:
    assert split_unique_name(UNIQUE) == (DRIVER, "vol-1")
    assert split_unique_name("kubernetes.io/csi/d^h^x") == ("d", "h^x")
    assert split_unique_name("kubernetes.io/aws-ebs/vol-1") is None
    assert split_unique_name("kubernetes.io/csi/^h") is None


def test_multi_node_volume_attaches_everywhere() -> None:
    ds = DesiredState()
    ds.set_pod(PodRef("ns", "a", "u1"), "node-a", [vol(multi=True)])
    ds.set_pod(PodRef("ns", "b", "u2"), "node-b", [vol(multi=True)])
    plan = run(ds, [], [node("node-a"), node("node-b")])
    assert sorted(e.node for e in plan.attaches) == ["node-a", "node-b"]


def test_detach_waits_for_the_node_to_stop_using_it() -> None:
    plan = run(DesiredState(), [att("node-a")], [node("node-a", in_use=(UNIQUE,), attached=(UNIQUE,))])
    assert not plan.detaches and plan.waiting_for_unmount == {att("node-a").name}
    assert plan.detach_requested == {att("node-a").name}, "the wait for unmount is timed"
    assert plan.node_status == {}, "still attached and listed"
    plan = run(DesiredState(), [att("node-a")], [node("node-a", attached=(UNIQUE,))])
    assert [d.forced for d in plan.detaches] == [False]
    assert plan.node_status == {"node-a": ()}, "unlisted in the same pass, before the VA is deleted"


def _detach_reasons(n: NodeInfo | None, now: float) -> list[str] | None:
    """None while the detach waits, else the force reasons of the planned detaches."""
    a = att("node-a")
    plan = run(DesiredState(), [a], [n] if n else [], unmount_wait_since={a.name: 0.0}, now=now)
    return [d.force_reason for d in plan.detaches] if plan.detaches else None


def test_forced_detach_only_on_an_unhealthy_node_after_the_wait() -> None:
    mounted = (UNIQUE,)
    assert _detach_reasons(node("node-a", in_use=mounted), 1000.0) is None, "a Ready node is waited for"
    assert _detach_reasons(node("node-a", in_use=mounted, ready=False), 360.0) is None, "not yet expired"
    assert _detach_reasons(node("node-a", in_use=mounted, ready=False), 361.0) == ["timeout"]


def test_out_of_service_taint_detaches_at_once() -> None:
    tainted = node("node-a", in_use=(UNIQUE,), out_of_service=True)
    assert _detach_reasons(tainted, 1.0) == ["out-of-service"]
    assert _detach_reasons(tainted, 400.0) == ["timeout"], "kcm names the timeout once it expired"


def test_deleted_node_keeps_its_last_mounts_and_waits_for_the_timeout() -> None:
    gone = node("node-a", in_use=(UNIQUE,), ready=False, exists=False)
    assert _detach_reasons(gone, 10.0) is None
    assert _detach_reasons(gone, 400.0) == ["timeout"]
    unmounted = node("node-a", ready=False, exists=False)
    assert _detach_reasons(unmounted, 10.0) == [""], "nothing mounted: detached at once"
    assert _detach_reasons(None, 10.0) is None, "a node never seen counts as mounting it"
    assert _detach_reasons(None, 400.0) == ["timeout"]
    plan = run(DesiredState(), [att("node-a")], [gone])
    assert plan.node_status == {}, "a deleted node's status is not written"


def test_unknown_volume_is_never_detached() -> None:
    unknown = Attachment("csi-x", "node-a", "pv", DRIVER, "", "", True, False)
    assert not run(DesiredState(), [unknown], [node("node-a")]).detaches
    assert not run(DesiredState(), [unknown], []).detaches


def test_deleting_attachment_blocks_reattach_until_gone() -> None:
    ds = DesiredState()
    ds.set_pod(PodRef("ns", "p", "u1"), "node-a", [vol()])
    plan = run(ds, [att("node-a", deleting=True)], [node("node-a")])
    assert not plan.attaches and not plan.detaches


def test_pod_contribution_is_replaced_and_removed() -> None:
    ds = DesiredState()
    ref = PodRef("ns", "p", "u1")
    ds.set_pod(ref, "node-a", [vol("v1"), vol("v2")])
    ds.set_pod(ref, "node-a", [vol("v2")])
    assert [e.volume.handle for e in ds.entries()] == ["v2"]
    ds.remove_pod(ref.key)
    assert ds.entries() == []


def test_pv_view_and_pod_termination() -> None:
    pv: PersistentVolume = {
        "metadata": {"name": "pv1"},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "volumeMode": "Block",
            "csi": {"driver": DRIVER, "volumeHandle": "vol-9", "readOnly": True},
        },
    }
    v = csi_volume(pv)
    assert v is not None and v.block and v.read_only and v.multi_node
    assert csi_volume(pv_view({"metadata": {"name": "x"}, "spec": {"hostPath": {"path": "/"}}})) is None
    running: PodStatus = {"containerStatuses": [{"state": {"running": {}}}]}
    assert not pod_terminated({"metadata": {"deletionTimestamp": "t"}, "status": running})
    assert pod_terminated({"metadata": {"deletionTimestamp": "t"}, "status": {}})
    assert pod_terminated({"metadata": {}, "status": {"phase": "Succeeded"}})
