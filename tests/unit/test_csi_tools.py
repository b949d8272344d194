"""csi_driver.backend.tools.run: tools beyond MAX_PARALLEL_TOOLS queue for a slot, and the timeout
counts from a tool's start, not from its wait for a slot."""

from __future__ import annotations

import asyncio
import time

import pytest

from csi_driver.backend import tools


def test_tools_beyond_the_limit_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tools, "MAX_PARALLEL_TOOLS", 2)

    async def main() -> float:
        start = time.monotonic()
        # Each queued tool waits 0.3 s for a slot before its own 0.5 s timeout starts.
        results = await asyncio.gather(*(tools.run("sleep", "0.3", timeout=0.5) for _ in range(6)))
        assert all(r.returncode == 0 for r in results)
        return time.monotonic() - start

    # Six 0.3 s tools two at a time: three waves, never fewer.
    assert asyncio.run(main()) >= 0.9


def test_a_tool_that_overruns_its_timeout_still_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tools, "MAX_PARALLEL_TOOLS", 1)

    async def main() -> None:
        with pytest.raises(tools.ToolError, match="timed out"):
            await tools.run("sleep", "5", timeout=0.2)

    asyncio.run(main())
