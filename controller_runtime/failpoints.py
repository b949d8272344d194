"""Named steps of a process where the fault-injection tests can stop it (kill -9 at that line).

A process declares its steps in a `Failpoints`; nothing shipped installs a hook (no flag or
environment variable arms one), so `reach` is a loop over an empty list. A test starts the process
through a test-only entry module that installs a hook and then runs the normal main.
"""

from __future__ import annotations

from collections.abc import Callable

Hook = Callable[[str], None]


class Failpoints:
    def __init__(self, *points: str) -> None:
        self.points = points
        self._hooks: list[Hook] = []

    def install(self, hook: Hook) -> None:
        """Adds a hook called with each point reached. Only tests call this."""
        self._hooks.append(hook)

    def reach(self, point: str) -> None:
        for hook in self._hooks:
            hook(point)
