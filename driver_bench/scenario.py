"""One scenario: a fresh driver from its recipe behind the fault proxy, the lifecycles driven
through it, and the oracles' verdict. `Bench` is the part a campaign and a replay share (the
driver, the proxy, the judging and the clean-up), so a reproducer is judged exactly as the
campaign judged the scenario it came from."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc

from localstack.leftovers import force_cleanup

from . import oracles
from .faults import Fault
from .lifecycle import Caller, CallFailed, DataAction, Lifecycle, Settings
from .oracles import Finding
from .proxy import Call, FaultProxy
from .recipe import Recipe
from .runner import NODE_ID, Driver, Layout


class Bench:
    """A driver from `recipe` on its own directories behind a `FaultProxy` injecting `fault`."""

    def __init__(self, recipe: Recipe, work: Path, fault: Fault | None, timeout_seconds: float) -> None:
        self.recipe, self.fault = recipe, fault
        # Sockets go in a short directory of their own: a unix socket's path is at most 107 bytes.
        self.layout = Layout(work, Path(tempfile.mkdtemp(prefix="dbench-")))
        self.driver = Driver(recipe, self.layout)
        self.proxy = FaultProxy(self.driver, self.layout.sockets / "proxy.sock", fault, timeout_seconds)

    async def __aenter__(self) -> Bench:
        # A directory left by an earlier run (the same --out twice) would hand the driver its old
        # state and the inventory its old volumes: each scenario starts empty. Unmounted first,
        # so that removing it never reaches into a volume still mounted there.
        force_cleanup(self.layout.work)
        shutil.rmtree(self.layout.work, ignore_errors=True)
        try:
            await self.driver.start()
            await self.proxy.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.proxy.stop()
        await self.driver.stop()
        # Whatever the driver left mounted or attached was judged already; the next scenario
        # and the machine must not inherit it.
        force_cleanup(self.layout.work)
        shutil.rmtree(self.layout.sockets, ignore_errors=True)

    def settings(self) -> Settings:
        r = self.recipe
        return Settings(
            kubelet_dir=self.layout.kubelet_dir,
            node_id=NODE_ID,
            size_bytes=r.volume.size_bytes,
            expand_to_bytes=r.volume.expand_to_bytes,
            fs_type=r.fs_type,
            mount_options=r.mount_options,
            parameters=r.parameters,
            snapshot_parameters=dict(r.snapshot_parameters),
        )

    async def judge(self, findings: list[Finding], completed: bool) -> list[Finding]:
        """The findings so far plus the end-of-scenario oracles. Inventory and leftovers are judged
        only when every lifecycle completed: after a failed call, what is left is its consequence,
        already reported."""
        await self.proxy.settle()
        out = list(findings)
        if self.proxy.restart_error is not None:
            out.append(Finding("restart-failed", str(self.proxy.restart_error)))
        if completed and self.proxy.restart_error is None:
            calls = [(c.method, c.request, c.response, c.code) for c in self.proxy.calls]
            try:
                held = await oracles.inventory(self.recipe, self.layout)
            except oracles.InventoryError as e:
                out.append(Finding("inventory-failed", str(e)))
            else:
                if held is not None:
                    out += oracles.compare(oracles.belief(calls), held)
            out += oracles.leftovers(self.layout.work)
        return oracles.dedupe(out)


@dataclass
class ScenarioResult:
    name: str
    fault: Fault | None
    work: Path
    findings: list[Finding]
    calls: list[Call]
    data: list[DataAction]
    seconds: float
    fired: bool
    completed: bool  # every lifecycle ran to its end (no call failed for good)
    reproducer: Path | None = None
    # Other directories whose paths the calls hold (a stack's other nodes): a replay's one driver
    # plays every node, so they all become its work directory.
    also_work: list[Path] = field(default_factory=list)
    # The stack campaign's second opinion: each finding's kind -> who has the bug, from the same
    # scenario run again with upstream's Go sidecars (stack_campaign.second_opinion).
    verdicts: dict[str, str] = field(default_factory=dict)


async def run_scenario(
    recipe: Recipe, work: Path, fault: Fault | None, concurrency: int, timeout_seconds: float, name: str
) -> ScenarioResult:
    t0 = time.monotonic()
    data: list[DataAction] = []
    async with Bench(recipe, work, fault, timeout_seconds) as bench:
        proxy = bench.proxy
        async with grpc.aio.insecure_channel(proxy.endpoint) as channel:
            caller = Caller(channel, bench.settings(), on_data=data.append)
            results: list[BaseException | None] = []
            try:
                caps = await caller.capabilities()
            except CallFailed as e:
                results.append(e)
            else:
                lifecycles = [
                    Lifecycle(caller, caps, name, i, lambda: len(proxy.calls)) for i in range(concurrency)
                ]
                results = list(await asyncio.gather(*(lc.run() for lc in lifecycles), return_exceptions=True))
        findings = list(caller.findings)
        for r in results:
            if isinstance(r, CallFailed):
                findings.append(Finding("call-failed", str(r)))
            elif isinstance(r, BaseException):
                raise r
        completed = not any(results)
        findings = await bench.judge(findings, completed=completed)
        return ScenarioResult(
            name=name,
            fault=fault,
            work=work,
            findings=findings,
            calls=list(proxy.calls),
            data=data,
            seconds=time.monotonic() - t0,
            fired=proxy.fired is not None,
            completed=completed,
        )
