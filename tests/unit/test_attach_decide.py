"""The attach-detach controller's pure decision: detach before attach, Multi-Attach, volumesInUse
protection, forced detach, node status lists, and the shared names."""

from __future__ import annotations

import hashlib

from controller_runtime.volumes import (
    attacher_finalizer,
    csi_volume,
    pod_terminated,
    unique_volume_name,
    va_name,
)
from services.attach_detach.state import (
    Attachment,
    DesiredState,
    DesiredVolume,
    NodeInfo,
    PodRef,
    decide,
)

DRIVER = "loop.csi.kubeloop.dev"


def vol(handle: str = "vol-1", multi: bool = False) -> DesiredVolume:
    return DesiredVolume(f"pv-{handle}", DRIVER, handle, unique_volume_name(DRIVER, handle), multi)


def att(node: str, handle: str = "vol-1", attached: bool = True, deleting: bool = False) -> Attachment:
    return Attachment(
        va_name(handle, DRIVER, node),
        node,
        f"pv-{handle}",
        DRIVER,
        handle,
        unique_volume_name(DRIVER, handle),
        attached,
        deleting,
    )


def node(
    name: str, in_use: tuple[str, ...] = (), ready: bool = True, attached: tuple[str, ...] = ()
) -> NodeInfo:
    return NodeInfo(name, True, ready, frozenset(in_use), attached)


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


def test_exclusive_volume_attached_elsewhere_is_refused() -> None:
    ds = DesiredState()
    ds.set_pod(PodRef("ns", "b", "u2"), "node-b", [vol()])
    plan = run(ds, [att("node-a")], [node("node-a"), node("node-b")])
    assert not plan.attaches
    assert [m.other_nodes for m in plan.multi_attach] == [("node-a",)]


def test_two_wishes_for_one_exclusive_volume_attach_only_one() -> None:
    ds = DesiredState()
    ds.set_pod(PodRef("ns", "a", "u1"), "node-a", [vol()])
    ds.set_pod(PodRef("ns", "b", "u2"), "node-b", [vol()])
    plan = run(ds, [], [node("node-a"), node("node-b")])
    assert [e.node for e in plan.attaches] == ["node-a"]
    assert [m.entry.node for m in plan.multi_attach] == ["node-b"]


def test_multi_node_volume_attaches_everywhere() -> None:
    ds = DesiredState()
    ds.set_pod(PodRef("ns", "a", "u1"), "node-a", [vol(multi=True)])
    ds.set_pod(PodRef("ns", "b", "u2"), "node-b", [vol(multi=True)])
    plan = run(ds, [], [node("node-a"), node("node-b")])
    assert sorted(e.node for e in plan.attaches) == ["node-a", "node-b"]


def test_detach_waits_for_the_node_to_stop_using_it() -> None:
    unique = unique_volume_name(DRIVER, "vol-1")
    plan = run(DesiredState(), [att("node-a")], [node("node-a", in_use=(unique,), attached=(unique,))])
    assert not plan.detaches and plan.waiting_for_unmount == {att("node-a").name}
    assert plan.node_status == {}, "still attached and listed"
    plan = run(DesiredState(), [att("node-a")], [node("node-a", attached=(unique,))])
    assert [d.forced for d in plan.detaches] == [False]
    assert plan.node_status == {"node-a": ()}, "unlisted in the same pass, before the VA is deleted"


def test_forced_detach_only_on_a_not_ready_node_after_the_wait() -> None:
    unique = unique_volume_name(DRIVER, "vol-1")
    a = att("node-a")
    since = {a.name: 0.0}
    ready = run(DesiredState(), [a], [node("node-a", in_use=(unique,))], unmount_wait_since=since, now=1000.0)
    assert not ready.detaches
    early = run(
        DesiredState(),
        [a],
        [node("node-a", in_use=(unique,), ready=False)],
        unmount_wait_since=since,
        now=10.0,
    )
    assert not early.detaches
    late = run(
        DesiredState(),
        [a],
        [node("node-a", in_use=(unique,), ready=False)],
        unmount_wait_since=since,
        now=400.0,
    )
    assert [d.forced for d in late.detaches] == [True]


def test_vanished_node_is_detached_and_unknown_volume_never_guessed() -> None:
    assert [d.attachment.node for d in run(DesiredState(), [att("gone")], []).detaches] == ["gone"]
    unknown = Attachment("csi-x", "node-a", "pv", DRIVER, "", "", True, False)
    assert not run(DesiredState(), [unknown], [node("node-a")]).detaches


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
    pv = {
        "metadata": {"name": "pv1"},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "volumeMode": "Block",
            "csi": {"driver": DRIVER, "volumeHandle": "vol-9", "readOnly": True},
        },
    }
    v = csi_volume(pv)
    assert v is not None and v.block and v.read_only and v.multi_node
    assert csi_volume({"metadata": {"name": "x"}, "spec": {"hostPath": {"path": "/"}}}) is None
    running: dict[str, object] = {"status": {"containerStatuses": [{"state": {"running": {}}}]}}
    assert not pod_terminated({"metadata": {"deletionTimestamp": "t"}, **running})
    assert pod_terminated({"metadata": {"deletionTimestamp": "t"}, "status": {}})
    assert pod_terminated({"metadata": {}, "status": {"phase": "Succeeded"}})
