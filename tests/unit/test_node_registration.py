"""The node agent registers its Node until it works, as kubelet does, instead of exiting when the
apiserver is unreachable or, just restarted, still answers 403 (found by the chaos campaign: the
node agent crash-looped through every apiserver restart)."""

from __future__ import annotations

from typing import Any, cast

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.http_client import CannotConnect
from controller_runtime.resources import Obj
from services.node_agent.node_status import NodeStatus


class Flaky:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.created: list[Obj] = []
        self.patched: list[Obj] = []

    async def create(self, _res: Any, body: Obj, *_a: Any, **_kw: Any) -> Obj:
        if self.failures:
            raise self.failures.pop(0)
        self.created.append(body)
        return body

    async def patch(self, _res: Any, _name: str, body: Obj, *_a: Any, **_kw: Any) -> Obj:
        self.patched.append(body)
        return body


async def test_registration_is_retried_until_the_apiserver_answers() -> None:
    client = Flaky(
        [
            CannotConnect("cannot connect to 127.0.0.1:6443"),
            ApiError(403, {"reason": "Forbidden"}),
            ApiError(503, {"reason": "ServiceUnavailable"}),
        ]
    )
    status = NodeStatus(
        cast(ApiClient, client),
        "node-a",
        capacity=(("cpu", "2"),),
        lease_duration=40,
        heartbeat=10.0,
        status_report=60.0,
    )
    await status.register(first_wait=0.001, max_wait=0.004)
    assert [b["metadata"]["name"] for b in client.created] == ["node-a"]
    assert client.patched and "status" in client.patched[-1], "then the status is reported"
