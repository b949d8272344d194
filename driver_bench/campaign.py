"""A fault campaign: the baseline scenario, then each fault on each step of the lifecycle, each
scenario on a fresh driver; findings written as reproducers, the whole as a report."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import report, reproducer
from .faults import STEPS, Fault, FaultKind, sweep
from .recipe import Recipe
from .scenario import ScenarioResult, run_scenario


@dataclass(frozen=True)
class Options:
    out: Path
    concurrency: int = 1
    kinds: tuple[FaultKind, ...] = tuple(FaultKind)
    steps: tuple[str, ...] = STEPS
    # Scenarios run at once, each with its own driver: how fast a sweep goes on a machine with
    # cores to spare. Faults never cross scenarios (each has its own directories and processes).
    parallel: int = 1
    timeout_seconds: float = 0.1  # the caller's deadline in a timeout fault


@dataclass(frozen=True)
class Outcome:
    results: list[ScenarioResult]
    report_json: Path
    report_md: Path
    seconds: float

    @property
    def findings(self) -> int:
        return sum(len(r.findings) for r in self.results)


def scenario_name(index: int, fault: Fault | None) -> str:
    return f"s{index:02d}-{fault.slug if fault else 'baseline'}"


async def run(recipe: Recipe, options: Options, faults: Sequence[Fault | None] | None = None) -> Outcome:
    t0 = time.monotonic()
    # Reproducers of an earlier run in the same directory would read as this run's findings.
    shutil.rmtree(options.out / "reproducers", ignore_errors=True)
    plan = list(faults) if faults is not None else sweep(options.kinds, options.steps)
    gate = asyncio.Semaphore(options.parallel)

    async def one(index: int, fault: Fault | None) -> ScenarioResult:
        name = scenario_name(index, fault)
        async with gate:
            result = await run_scenario(
                recipe,
                options.out / "scenarios" / name,
                fault,
                options.concurrency,
                options.timeout_seconds,
                name,
            )
        if result.findings:
            result.reproducer = reproducer.write(
                result, recipe.path, options.out / "reproducers" / f"{name}.json", options.timeout_seconds
            )
        return result

    tasks = [asyncio.ensure_future(one(i, f)) for i, f in enumerate(plan)]
    try:
        results = list(await asyncio.gather(*tasks))
    except BaseException:
        # A bad recipe (or anything else) stops the campaign: every other scenario's driver is
        # stopped by its own clean-up as its task is cancelled.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    seconds = time.monotonic() - t0
    settings = {
        "concurrency": options.concurrency,
        "parallel": options.parallel,
        "timeout_seconds": options.timeout_seconds,
        "faults": ",".join(k.value for k in options.kinds),
    }
    doc = report.to_json(str(recipe.path), results, settings, seconds)
    j, m = report.write(options.out, doc)
    return Outcome(results, j, m, seconds)
