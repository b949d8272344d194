"""Leader election on a fake clock. A leader that cannot renew while the apiserver is unreachable
stops with LeadershipLost (the reason a supervisor's log should show), not with the connection
error of a release it must not attempt: after the loss the Lease may be someone else's. A standby
takes an abandoned Lease only once its record has not changed for the lease duration on the
standby's own clock, and every timestamp it writes is that clock's."""

from __future__ import annotations

import asyncio
import copy
import datetime

import pytest

from controller_runtime.client import ApiError
from controller_runtime.clock import micro_time
from controller_runtime.clock_testing import FakeClock
from controller_runtime.http_client import CannotConnect
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
            raise CannotConnect("cannot connect to 127.0.0.1:6443")

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
    clock = FakeClock()
    config = LeaderElectionConfig(
        "kube-system", "test", "a", lease_duration=1.0, renew_deadline=0.3, retry_period=0.1
    )
    elector = LeaderElector(client, config, clock)  # type: ignore[arg-type]
    leading = asyncio.Event()

    async def lead() -> None:
        leading.set()
        await asyncio.Event().wait()  # leads until stopped

    task = asyncio.create_task(elector.run(lead))
    await asyncio.wait_for(leading.wait(), 5)
    client.down = True
    # The next renewal is due after retry_period; it fails until renew_deadline has passed.
    await clock.advance(0.1 + 0.3 - 0.05)
    assert not task.done(), "still leading within the renew deadline"
    await clock.advance(0.15)
    assert task.done()
    with pytest.raises(LeadershipLost):
        await task
    client.down = False
    await elector.release()  # a second stop: still nothing to release
    assert all(w["spec"]["holderIdentity"] == "a" for w in client.writes), "no release after the loss"
    assert not elector.is_leader


async def test_a_standby_takes_an_abandoned_lease_after_the_lease_duration_on_its_own_clock() -> None:
    client = FlakyLeases()
    clock = FakeClock()
    config = LeaderElectionConfig("kube-system", "test", "a")  # client-go's 15 s / 10 s / 5 s
    crashed = LeaderElector(client, config, clock)  # type: ignore[arg-type]
    assert await crashed.try_acquire_or_renew()  # holds the Lease, then never renews it
    acquired = client.lease["spec"]["acquireTime"] if client.lease else ""
    assert acquired == micro_time(clock.now()) == "2026-01-01T00:00:00.000000Z"
    standby = LeaderElector(client, LeaderElectionConfig("kube-system", "test", "b"), clock)  # type: ignore[arg-type]
    leading = asyncio.Event()

    async def lead() -> None:
        leading.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(standby.run(lead))
    await clock.advance(15.0)  # tries at 0, 5, 10 and 15 s: not expired until after 15 s
    assert not leading.is_set() and client.lease and client.lease["spec"]["holderIdentity"] == "a"
    await clock.advance(5.0)
    assert leading.is_set() and standby.is_leader
    spec = client.lease["spec"] if client.lease else {}
    taken_at = micro_time(datetime.datetime(2026, 1, 1, 0, 0, 20, tzinfo=datetime.UTC))
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)
    assert spec["acquireTime"] == spec["renewTime"] == taken_at, "stamped with the clock's time"
    await clock.advance(5.0)  # renewed every retry_period
    assert client.lease and client.lease["spec"]["renewTime"] == micro_time(clock.now())
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert client.lease and client.lease["spec"]["holderIdentity"] is None, "released on a graceful stop"
