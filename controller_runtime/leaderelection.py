"""Leader election on a coordination.k8s.io/v1 Lease, with client-go's timing rules.

A candidate acquires the Lease when nobody holds it or the holder's record has not changed for
`lease_duration` as observed on *our* clock (clocks are never compared across machines). The
leader renews every `retry_period`; if it cannot renew within `renew_deadline` it stops leading
(the component exits, as upstream does, so it can never act on a lease it lost). On a graceful
stop the leader releases the Lease so a standby takes over at once instead of after expiry.
Every wait, deadline and timestamp is on the injected clock (client-go's LeaderElectionConfig.Clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from .client import ApiClient, ApiError
from .clock import SYSTEM_CLOCK, Clock, micro_time
from .logs import get_logger
from .metrics import Gauge
from .resources import LEASES, Obj, object_key

log = get_logger("leaderelection")

IS_LEADER = Gauge("leader_election_master_status", "1 while this process holds the lease", ["name"])


class LeadershipLost(Exception):
    pass


@dataclass
class LeaderElectionConfig:
    namespace: str
    name: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 5.0


class LeaderElector:
    def __init__(self, client: ApiClient, config: LeaderElectionConfig, clock: Clock = SYSTEM_CLOCK) -> None:
        self.client = client
        self.config = config
        self.clock = clock
        self._observed_record: Obj | None = None
        self._observed_at = 0.0
        self._lease: Obj | None = None
        self._gauge = IS_LEADER.labels(config.name)
        self._key = object_key(config.namespace, config.name)

    @property
    def is_leader(self) -> bool:
        return self._lease is not None and self._holder(self._lease) == self.config.identity

    @staticmethod
    def _holder(lease: Obj) -> str:
        return str(lease.get("spec", {}).get("holderIdentity") or "")

    def _observe(self, lease: Obj) -> None:
        spec = lease.get("spec", {})
        if spec != self._observed_record:
            self._observed_record = copy.deepcopy(spec)
            self._observed_at = self.clock.monotonic()

    def _spec(self, transitions: int, acquire_time: str) -> Obj:
        now = micro_time(self.clock.now())
        return {
            "holderIdentity": self.config.identity,
            "leaseDurationSeconds": int(self.config.lease_duration),
            "acquireTime": acquire_time or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True when we hold the lease afterwards."""
        cfg = self.config
        try:
            lease = await self.client.get(LEASES, cfg.name, cfg.namespace)
        except ApiError as exc:
            if not exc.not_found:
                raise
            body = {"metadata": {"name": cfg.name, "namespace": cfg.namespace}, "spec": self._spec(0, "")}
            try:
                self._lease = await self.client.create(LEASES, body)
            except ApiError as create_exc:
                if create_exc.conflict:
                    return False
                raise
            self._observe(self._lease)
            return True
        self._observe(lease)
        holder = self._holder(lease)
        spec = lease.get("spec", {})
        duration = float(spec.get("leaseDurationSeconds") or cfg.lease_duration)
        expired = self.clock.monotonic() > self._observed_at + duration
        if holder and holder != cfg.identity and not expired:
            self._lease = lease
            return False
        transitions = int(spec.get("leaseTransitions") or 0)
        ours = holder == cfg.identity
        lease["spec"] = self._spec(
            transitions if ours else transitions + 1, spec.get("acquireTime", "") if ours else ""
        )
        try:
            self._lease = await self.client.update(LEASES, lease)
        except ApiError as exc:
            if exc.conflict:
                return False  # someone else wrote first; look again next round
            raise
        self._observe(self._lease)
        return True

    async def _acquire(self) -> None:
        logged = False
        while True:
            try:
                if await self.try_acquire_or_renew():
                    log.info(
                        "acquired lease",
                        lease=self._key,
                        identity=self.config.identity,
                    )
                    self._gauge.set(1)
                    return
                if not logged:
                    log.info(
                        "waiting to acquire lease",
                        lease=self._key,
                        holder=self._holder(self._lease or {}),
                    )
                    logged = True
            except Exception as exc:
                log.warning("error acquiring lease", error=str(exc))
            await self.clock.sleep(self.config.retry_period)

    async def _renew_loop(self) -> None:
        cfg = self.config
        while True:
            await self.clock.sleep(cfg.retry_period)
            deadline = self.clock.monotonic() + cfg.renew_deadline
            while True:
                try:
                    remaining = deadline - self.clock.monotonic()
                    if remaining > 0 and await self.clock.wait_for(self.try_acquire_or_renew(), remaining):
                        break
                except Exception as exc:
                    log.warning("error renewing lease", error=str(exc))
                if self.clock.monotonic() >= deadline:
                    self._gauge.set(0)
                    # Lost: the record is no longer ours to write (another replica may hold the
                    # Lease by now), so there is nothing to release, as in client-go.
                    self._lease = None
                    raise LeadershipLost(f"could not renew lease {self._key} within {cfg.renew_deadline}s")
                await self.clock.sleep(min(1.0, cfg.retry_period))

    async def release(self) -> None:
        if not self.is_leader or self._lease is None:
            return
        lease = copy.deepcopy(self._lease)
        spec = lease.setdefault("spec", {})
        now = self.clock.now()
        spec.update(
            {
                "holderIdentity": None,
                "leaseDurationSeconds": 1,
                "renewTime": micro_time(now),
                "acquireTime": micro_time(now),
            }
        )
        try:
            await self.client.update(LEASES, lease)
            log.info("released lease", lease=self._key)
        except (ApiError, OSError) as exc:
            # Best effort: the Lease expires by itself. An unreachable apiserver must not replace
            # the error the elector is stopping for.
            log.warning("could not release lease", error=str(exc))
        self._lease = None
        self._gauge.set(0)

    async def run(self, lead: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Waits for the lease, then runs `lead` while renewing. Raises LeadershipLost if renewal
        fails; releases the lease when cancelled or when `lead` returns."""
        await self._acquire()
        lead_task = asyncio.create_task(lead(), name="leading")
        renew_task = asyncio.create_task(self._renew_loop(), name="lease-renew")
        try:
            done, _ = await asyncio.wait({lead_task, renew_task}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise LeadershipLost or lead's error
        finally:
            for task in (lead_task, renew_task):
                task.cancel()
            for task in (lead_task, renew_task):
                with contextlib.suppress(asyncio.CancelledError, LeadershipLost):
                    await task
            await asyncio.shield(self.release())
