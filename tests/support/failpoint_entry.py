"""What the test-only entry modules that arm failpoints share: the `--failpoints=a,b` flag taken
out of a process's own argv, and the hook that SIGKILLs the process at the first of them, exactly
like `kill -9` at that line (controller_runtime.failpoints, external_provisioner.failpoints)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Collection, Sequence


def take_failpoints(argv: Sequence[str], known: Collection[str]) -> tuple[set[str], list[str]]:
    """(the failpoints named by --failpoints flags, the rest of argv); unknown names exit."""
    points: set[str] = set()
    rest = []
    for arg in argv:
        if arg.startswith("--failpoints="):
            points |= set(filter(None, arg.split("=", 1)[1].split(",")))
        else:
            rest.append(arg)
    if unknown := points - set(known):
        raise SystemExit(f"unknown failpoints {sorted(unknown)}; known: {', '.join(known)}")
    return points, rest


def kill_at(points: Collection[str], say: Callable[[str], None] = lambda _: None) -> Callable[[str], None]:
    """A hook that kills the process the first time it reaches one of `points`."""

    def hook(point: str) -> None:
        if point in points:
            say(point)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook
