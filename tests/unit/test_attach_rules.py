"""The attach rules (controller_runtime.attach_rules) as kcm has them, and the attach-detach
controller and the explainer (kubectl_kubeloop.diagnose) agreeing on the same objects: the
explainer blames Multi-Attach exactly when the controller refuses the attach, talks of an attach
exactly when the controller wants one, and calls a node Ready exactly when the controller does."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from controller_runtime.attach_rules import attach_required, multi_attach_allowed, node_ready
from controller_runtime.client import ApiClient
from controller_runtime.clock_testing import FakeClock
from controller_runtime.controller import ControllerContext
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.resources import Obj
from controller_runtime.volumes import ANN_CONTROLLER_MANAGED, va_name
from kubectl_kubeloop.diagnose import Report, diagnose
from kubectl_kubeloop.snapshot import Snapshot
from services.attach_detach.controller import AttachDetachController, Options
from services.attach_detach.decide import Plan

DRIVER = "loop.csi.kubeloop.dev"
RWO, RWOP, ROX, RWX = "ReadWriteOnce", "ReadWriteOncePod", "ReadOnlyMany", "ReadWriteMany"
T0 = "2026-01-01T00:00:00Z"


def test_multi_attach_follows_kcm_is_multi_attach_allowed() -> None:
    assert multi_attach_allowed(())  # no modes: unknown, the attacher may refuse
    assert multi_attach_allowed((RWX,))
    assert multi_attach_allowed((ROX,))
    assert multi_attach_allowed((RWO, ROX))
    assert not multi_attach_allowed((RWO,))
    assert not multi_attach_allowed((RWOP,))
    assert not multi_attach_allowed((RWO, RWOP))


def test_attach_required_follows_kcm_skip_attach() -> None:
    assert attach_required(None)  # no CSIDriver
    assert attach_required({"spec": {}})
    assert attach_required({"spec": {"attachRequired": None}})
    assert attach_required({"spec": {"attachRequired": True}})
    assert not attach_required({"spec": {"attachRequired": False}})


def test_node_ready_is_the_ready_condition_true() -> None:
    assert not node_ready(None)
    assert not node_ready({"status": {}})
    assert not node_ready({"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}})
    assert node_ready({"status": {"conditions": [{"type": "Ready", "status": "True"}]}})


# -- the controller and the explainer on the same objects -------------------------------------------


def _node(name: str, ready: str = "True") -> Obj:
    return {
        "metadata": {"name": name, "annotations": {ANN_CONTROLLER_MANAGED: "true"}},
        "status": {"conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": T0}]},
    }


def _pv(modes: tuple[str, ...], block: bool) -> Obj:
    spec: Obj = {
        "accessModes": list(modes),
        "csi": {"driver": DRIVER, "volumeHandle": "v"},
        "claimRef": {"namespace": "ns", "name": "c", "uid": "cu"},
    }
    if block:
        spec["volumeMode"] = "Block"
    return {"metadata": {"name": "pv-v", "uid": "pvu"}, "spec": spec, "status": {"phase": "Bound"}}


def _claim() -> Obj:
    return {
        "metadata": {"namespace": "ns", "name": "c", "uid": "cu", "creationTimestamp": T0},
        "spec": {"volumeName": "pv-v", "resources": {"requests": {"storage": "1Gi"}}},
        "status": {"phase": "Bound", "capacity": {"storage": "1Gi"}},
    }


def _pod(name: str, node: str, running: bool) -> Obj:
    conditions = [{"type": "Ready", "status": "True", "lastTransitionTime": T0}] if running else []
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": f"u-{name}", "creationTimestamp": T0},
        "spec": {"nodeName": node, "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "c"}}]},
        "status": {"phase": "Running" if running else "Pending", "conditions": conditions},
    }


def _va(node: str, attached: bool = True, deleting: bool = False, error: str = "") -> Obj:
    md: Obj = {"name": va_name("v", DRIVER, node), "uid": f"vau-{node}", "creationTimestamp": T0}
    if attached:  # when the attacher wrote status.attached, as the explainer reads it
        md["managedFields"] = [{"manager": "csi-attacher", "subresource": "status", "time": T0}]
    if deleting:
        md["deletionTimestamp"] = T0
    status: Obj = {"attached": attached}
    if error:
        status["attachError"] = {"message": error}
    return {
        "metadata": md,
        "spec": {"attacher": DRIVER, "nodeName": node, "source": {"persistentVolumeName": "pv-v"}},
        "status": status,
    }


class _NoWrites:
    async def create(self, *_: Any, **__: Any) -> Obj:
        raise AssertionError("the test only asks for the decision")


def _new_controller() -> AttachDetachController:
    client = cast(ApiClient, _NoWrites())
    factory = SharedInformerFactory(client)
    context = ControllerContext(client, factory, cast(EventRecorder, object()), FakeClock())
    return AttachDetachController(context, Options())


def _controller_plan(objects: dict[str, Any]) -> Plan:
    """The attach-detach controller's own decision (its translation of the objects and `decide`)
    on `objects`, as one pass would make it."""
    c = _new_controller()
    for node in objects["nodes"]:
        c.nodes.store.upsert(node)
        c._node_added(node)
    c.pvs.store.upsert(objects["pv"])
    c.pvcs.store.upsert(objects["claim"])
    if objects["csi_driver"] is not None:
        c.drivers.store.upsert(objects["csi_driver"])
    for va in objects["vas"]:
        c.vas.store.upsert(va)
    c.seed_actual_state()
    for pod in objects["pods"]:
        c.pods.store.upsert(pod)
        asyncio.run(c.sync_pod(f"ns/{pod['metadata']['name']}"))
    _, _, plan = c._decide(c.clock.monotonic())
    return plan


def _explain(objects: dict[str, Any]) -> Report:
    snap = Snapshot(
        claim=objects["claim"],
        volume=objects["pv"],
        attachments=objects["vas"],
        pods=objects["pods"],
        nodes={n["metadata"]["name"]: n for n in objects["nodes"]},
        csi_driver=objects["csi_driver"],
    )
    return diagnose(snap)


def _objects(
    modes: tuple[str, ...], block: bool = False, va_a: Obj | None = None, csi_driver: Obj | None = None
) -> dict[str, Any]:
    """Volume v attached to node-a (used there by pod a), and pod b on node-b wanting it too."""
    return {
        "nodes": [_node("node-a"), _node("node-b")],
        "pv": _pv(modes, block),
        "claim": _claim(),
        "csi_driver": csi_driver,
        "vas": [va_a if va_a is not None else _va("node-a")],
        "pods": [_pod("a", "node-a", running=True), _pod("b", "node-b", running=False)],
    }


CASES = {
    "no access modes": ((), False),
    "RWO": ((RWO,), False),
    "RWOP": ((RWOP,), False),
    "RWX": ((RWX,), False),
    "ROX": ((ROX,), False),
    "RWO and ROX": ((RWO, ROX), False),
    "block, no access modes": ((), True),
    "block RWO": ((RWO,), True),
    "block RWX": ((RWX,), True),
}


@pytest.mark.parametrize("case", CASES)
def test_explainer_blames_multi_attach_exactly_when_the_controller_refuses(case: str) -> None:
    modes, block = CASES[case]
    objects = _objects(modes, block)
    plan = _controller_plan(objects)
    report = _explain(objects)
    refused = [r.entry.node for r in plan.multi_attach]
    attaching = [e.node for e in plan.attaches]
    blamed = [w.reason for w in report.waiting if "Multi-Attach" in w.reason]
    assert bool(refused) == bool(blamed) == (not multi_attach_allowed(modes))
    if refused:
        assert refused == ["node-b"] and not attaching
        assert "attached to node-a" in blamed[0] and "pod a" in blamed[0]
    else:
        assert attaching == ["node-b"]
        assert [w.component for w in report.waiting] == ["attach-detach controller"]
        assert "no VolumeAttachment for pv-v on node-b yet" in report.waiting[0].reason


@pytest.mark.parametrize(
    "va_a",
    [_va("node-a", deleting=True), _va("node-a", attached=False, error="boom")],
    ids=["detaching elsewhere", "uncertain elsewhere"],
)
def test_an_exclusive_volume_not_held_elsewhere_is_no_multi_attach(va_a: Obj) -> None:
    """A VolumeAttachment elsewhere that is being deleted makes the controller wait, one whose
    attach failed (uncertain) blocks nothing: neither is a Multi-Attach refusal, and the explainer
    says neither is."""
    objects = _objects((RWO,), va_a=va_a)
    plan = _controller_plan(objects)
    report = _explain(objects)
    assert not plan.multi_attach
    assert not [w for w in report.waiting if "Multi-Attach" in w.reason]
    if va_a["metadata"].get("deletionTimestamp"):
        assert not plan.attaches
        assert "being detached from node-a" in report.waiting[0].reason
    else:
        assert [e.node for e in plan.attaches] == ["node-b"]


@pytest.mark.parametrize("attach", [None, True, False], ids=["unset", "true", "false"])
def test_controller_and_explainer_agree_on_attach_required(attach: bool | None) -> None:
    """attachRequired null is required for both (kcm skips the attach only on false)."""
    objects = _objects((RWO,), csi_driver={"metadata": {"name": DRIVER}, "spec": {"attachRequired": attach}})
    objects["vas"] = []  # nothing attached yet: pod b alone wants the volume
    objects["pods"] = [_pod("b", "node-b", running=False)]
    plan = _controller_plan(objects)
    report = _explain(objects)
    wants_attach = [e.node for e in plan.attaches] == ["node-b"]
    assert wants_attach == (attach is not False)
    assert any(w.component == "attach-detach controller" for w in report.waiting) == wants_attach


def test_controller_and_explainer_agree_on_node_ready() -> None:
    nodes = [
        _node("node-a"),
        _node("node-b", ready="Unknown"),
        {"metadata": {"name": "node-c"}, "status": {}},
    ]
    objects = {**_objects((RWO,)), "nodes": nodes}
    c = _new_controller()
    for node in nodes:
        c.nodes.store.upsert(node)
    controller = {name: info.ready for name, info in c.node_infos().items()}
    explainer = {link.name: link.state == "Ready" for link in _explain(objects).chain if link.kind == "Node"}
    assert controller == explainer == {"node-a": True, "node-b": False, "node-c": False}
