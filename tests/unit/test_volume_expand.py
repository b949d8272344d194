"""The volume-expand controller's sync with its claim cache filled by hand, an in-memory client
for the live PV read, and a recorder that keeps what it is given: which claims get kcm's
`ExternalExpanding` event, and of which type."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

from controller_runtime.client import ApiClient
from controller_runtime.controller import ControllerContext
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.resize_status import PRE_RESIZE_CAPACITY
from controller_runtime.resources import Obj, Resource
from services.volume_expand.controller import EXTERNAL_EXPANDING, MSG_EXTERNAL, ExpandController


@dataclass
class Volumes:
    """The client: answers a get from a dict of PVs."""

    pvs: dict[str, Obj] = field(default_factory=dict)

    async def get(self, res: Resource, name: str, *_: Any, **__: Any) -> Obj:
        return self.pvs[name]


@dataclass
class Events:
    items: list[tuple[str, str, str, str]] = field(default_factory=list)

    def normal(self, obj: Obj, reason: str, message: str) -> None:
        self.items.append(("Normal", obj["metadata"]["name"], reason, message))

    def warning(self, obj: Obj, reason: str, message: str) -> None:
        self.items.append(("Warning", obj["metadata"]["name"], reason, message))


def claim(request: str, capacity: str) -> Obj:
    return {
        "metadata": {"namespace": "ns", "name": "c", "uid": "cu"},
        "spec": {"volumeName": "pv", "resources": {"requests": {"storage": request}}},
        "status": {"phase": "Bound", "capacity": {"storage": capacity}},
    }


def volume(annotations: dict[str, str] | None = None) -> Obj:
    return {
        "metadata": {"name": "pv", "annotations": annotations or {}},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "csi": {"driver": "loop.csi.kubeloop.dev", "volumeHandle": "h"},
            "claimRef": {"namespace": "ns", "name": "c", "uid": "cu"},
        },
    }


def run(c: Obj, pv: Obj) -> list[tuple[str, str, str, str]]:
    events = Events()
    client = cast(ApiClient, Volumes({"pv": pv}))
    context = ControllerContext(client, SharedInformerFactory(client), cast(EventRecorder, events))
    controller = ExpandController(context)
    controller.claims.store.upsert(c)
    asyncio.run(controller.sync("ns/c"))
    return events.items


def test_grown_request_is_a_normal_external_expanding_event() -> None:
    assert run(claim("2Gi", "1Gi"), volume()) == [("Normal", "c", EXTERNAL_EXPANDING, MSG_EXTERNAL)]


def test_pre_resize_annotation_alone_brings_the_event() -> None:
    """kcm acts on a PV the resizer marked even when the claim's request is already met."""
    marked = volume({PRE_RESIZE_CAPACITY: "1Gi"})
    assert run(claim("2Gi", "2Gi"), marked) == [("Normal", "c", EXTERNAL_EXPANDING, MSG_EXTERNAL)]
    assert run(claim("2Gi", "2Gi"), volume()) == []
