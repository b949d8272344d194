"""A leader that cannot renew while the apiserver is unreachable stops with LeadershipLost (the
reason a supervisor's log should show), not with the connection error of a release it must not
attempt: after the loss the Lease may be someone else's."""

from __future__ import annotations

import asyncio
import copy
import time

import aiohttp
import pytest

from controller_runtime.client import ApiError
from controller_runtime.leaderelection import LeaderElectionConfig, LeaderElector, LeadershipLost
from controller_runtime.resources import Obj, Resource


class FlakyLeases:
    """One Lease in memory; while `down`, every call fails as a refused connection does."""

    def __init__(self) -> None:
        self.lease: Obj | None = None
        self.down = False
        self.writes: list[Obj] = []
        self.rv = 0

    def _check(self) -> None:
        if self.down:
            raise aiohttp.ClientConnectionError("Cannot connect to host 127.0.0.1")

    async def get(self, _res: Resource, name: str, _namespace: str | None = None) -> Obj:
        self._check()
        if self.lease is None:
            raise ApiError(404, {"reason": "NotFound"})
        return copy.deepcopy(self.lease)

    async def create(self, _res: Resource, obj: Obj, _namespace: str | None = None) -> Obj:
        self._check()
        return await self._write(obj)

    async def update(self, _res: Resource, obj: Obj) -> Obj:
        self._check()
        return await self._write(obj)

    async def _write(self, obj: Obj) -> Obj:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.lease = obj
        self.writes.append(copy.deepcopy(obj))
        return copy.deepcopy(obj)


async def test_lost_lease_is_the_error_and_nothing_is_released() -> None:
    client = FlakyLeases()
    config = LeaderElectionConfig(
        "kube-system", "test", "a", lease_duration=1.0, renew_deadline=0.3, retry_period=0.1
    )
    elector = LeaderElector(client, config)  # type: ignore[arg-type]
    leading = asyncio.Event()

    async def lead() -> None:
        leading.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(elector.run(lead))
    await asyncio.wait_for(leading.wait(), 5)
    client.down = True
    started = time.monotonic()
    with pytest.raises(LeadershipLost):
        await asyncio.wait_for(task, 5)
    assert time.monotonic() - started < 2
    client.down = False
    await elector.release()  # a second stop: still nothing to release
    assert all(w["spec"]["holderIdentity"] == "a" for w in client.writes), "no release after the loss"
    assert not elector.is_leader
