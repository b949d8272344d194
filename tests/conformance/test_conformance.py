"""The conformance subset in `make test`: each marked scenario run against the Go components and
against kubeloop on real control planes (tests/conformance/runner.py), one test per scenario, a
difference failing it with the unified diff. `make conformance` runs every scenario."""

from __future__ import annotations

import pytest
import pytest_asyncio

from .suite import Report, run_suite, select

SUBSET = select(subset=True)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def report() -> Report:
    # Never skipped: a missing Go binary fails here naming the build command.
    result = await run_suite(SUBSET, verbose=False)
    path = result.write()
    print(f"\n{result.summary()} ({result.seconds}); report: {path}")
    return result


@pytest.mark.integration
@pytest.mark.root
@pytest.mark.parametrize("name", [s.name for _, s in SUBSET])
async def test_scenario(report: Report, name: str) -> None:
    verdict = next(v for v in report.verdicts if v.scenario == name)
    assert verdict.status != "differ", f"{name}: go and kubeloop differ\n{verdict.diff}"
