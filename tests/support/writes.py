"""An API write a test repeats until the apiserver takes it: a Node's status that kcm's node
controllers write too (a conflict), a CSIDriver whose deletion is still in flight (it already
exists). Each attempt reads afresh; any other error fails at once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from controller_runtime.client import ApiError
from tests.support.waits import eventually_async


async def until_written(
    what: str,
    write: Callable[[], Awaitable[object]],
    again: Callable[[ApiError], bool],
    timeout: float = 10.0,
) -> None:
    """Calls `write` until it returns, again after each ApiError that `again` accepts."""

    async def written() -> bool:
        try:
            await write()
            return True
        except ApiError as err:
            if not again(err):
                raise
            return False

    await eventually_async(what, written, timeout)
