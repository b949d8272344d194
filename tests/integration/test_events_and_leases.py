"""Event aggregation and leader election against the real apiserver."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from controller_runtime.client import ApiClient
from controller_runtime.events import EventRecorder
from controller_runtime.leaderelection import LeaderElectionConfig, LeaderElector
from controller_runtime.resources import EVENTS, LEASES, PERSISTENT_VOLUME_CLAIMS
from tests.support.waits import consistently_async, eventually_async

pytestmark = pytest.mark.integration


async def test_repeated_events_aggregate_into_one_with_count(api: ApiClient, namespace: str) -> None:
    claim = await api.create(
        PERSISTENT_VOLUME_CLAIMS,
        {
            "metadata": {"name": "data"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
        },
        namespace,
    )
    recorder = EventRecorder(api, "persistentvolume-controller")
    for _ in range(3):
        recorder.warning(claim, "FailedBinding", "no persistent volumes available for this claim")
    recorder.normal(claim, "ExternalProvisioning", "waiting for a volume to be created")
    await recorder.flush()
    events = (await api.list_page(EVENTS, namespace))["items"]
    failed = [e for e in events if e["reason"] == "FailedBinding"]
    assert len(failed) == 1 and failed[0]["count"] == 3
    assert failed[0]["involvedObject"]["uid"] == claim["metadata"]["uid"]
    assert failed[0]["type"] == "Warning"
    assert [e["count"] for e in events if e["reason"] == "ExternalProvisioning"] == [1]
    await recorder.close()


def config(name: str, identity: str, lease_duration: float = 3) -> LeaderElectionConfig:
    return LeaderElectionConfig(
        namespace="kube-system",
        name=name,
        identity=identity,
        lease_duration=lease_duration,
        renew_deadline=lease_duration * 2 / 3,
        retry_period=0.3,
    )


async def test_leader_election_hands_over_when_the_holder_stops(api: ApiClient) -> None:
    name = f"le-{uuid.uuid4().hex[:8]}"
    # A lease far longer than a release takes: a hand-over before it expires can only be the
    # release (with 3 s, a loaded CI machine made release and expiry indistinguishable).
    a, b = LeaderElector(api, config(name, "a", 12)), LeaderElector(api, config(name, "b", 12))
    leading: list[str] = []

    def lead_as(who: str):  # type: ignore[no-untyped-def]
        async def lead() -> None:
            leading.append(who)
            await asyncio.Event().wait()

        return lead

    async def leaders() -> list[str]:
        return list(leading)

    task_a = asyncio.create_task(a.run(lead_as("a")))
    await eventually_async("a leading", leaders, 5, satisfied=lambda who: who == ["a"])
    task_b = asyncio.create_task(b.run(lead_as("b")))
    await consistently_async("b waiting while a renews", leaders, 1.5, satisfied=lambda who: who == ["a"])
    stopped = time.monotonic()
    task_a.cancel()  # a graceful stop releases the lease
    await eventually_async("b leading after a", leaders, 8, 0.05, satisfied=lambda who: who == ["a", "b"])
    assert time.monotonic() - stopped < 8, "release lets b take over before the lease would expire"
    lease = await api.get(LEASES, name, "kube-system")
    assert lease["spec"]["holderIdentity"] == "b"
    assert lease["spec"]["leaseTransitions"] >= 1
    task_b.cancel()
    await asyncio.gather(task_a, task_b, return_exceptions=True)


async def test_leader_election_takes_over_an_expired_lease(api: ApiClient) -> None:
    name = f"le-{uuid.uuid4().hex[:8]}"
    crashed = LeaderElector(api, config(name, "crashed"))
    assert await crashed.try_acquire_or_renew()  # holds the lease, then never renews (a kill -9)
    b = LeaderElector(api, config(name, "b"))
    assert not await b.try_acquire_or_renew()
    start = time.monotonic()
    await eventually_async("b taking the expired lease", b.try_acquire_or_renew, 10, 0.2)
    assert time.monotonic() - start >= 2.5, "must wait out the lease duration on its own clock"
