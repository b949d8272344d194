"""external-attacher: PV finalizer checks share a VolumeAttachment LIST only when it began after
their cache check, so the list still holds any VA created before it."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from controller_runtime.client import ApiClient
from controller_runtime.clock_testing import FakeClock
from external_attacher.controller import Attacher


class _Lists:
    def __init__(self) -> None:
        self.calls = 0
        self.release = asyncio.Event()

    async def list_all(self, _res: Any) -> tuple[list[dict[str, Any]], str]:
        self.calls += 1
        n = self.calls
        await self.release.wait()
        return [{"metadata": {"name": f"list-{n}"}}], "1"


def test_checks_share_a_list_begun_after_them_and_never_an_older_one() -> None:
    async def main() -> None:
        a = Attacher.__new__(Attacher)
        lists = _Lists()
        a.client = cast(ApiClient, lists)
        a._va_list = None
        a.clock = clock = FakeClock()
        t1 = clock.monotonic()
        first = asyncio.create_task(a._vas_listed_after(t1))
        await asyncio.sleep(0)
        second = asyncio.create_task(a._vas_listed_after(t1))  # checked before the list began
        await asyncio.sleep(0)
        clock.step(0.001)
        late = asyncio.create_task(a._vas_listed_after(clock.monotonic()))  # checked after
        await asyncio.sleep(0)
        lists.release.set()
        r1, r2, r3 = await asyncio.gather(first, second, late)
        assert r1 is r2, "both began their check before the list: one LIST serves both"
        assert r3[0]["metadata"]["name"] == "list-2", "a check after the list began needs a new one"
        assert lists.calls == 2

    asyncio.run(main())
