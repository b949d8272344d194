"""Test-only entry point: the real CSI driver with a failpoint hook installed.

    python -m tests.csi.driver_failpoints --failpoints=move-after-pull [driver flags]

SIGKILLs the process the first time it reaches one of the named steps
(csi_driver.transfer.moves.MOVE_STEPS), exactly like `kill -9` at that line. The shipped
`kubeloop-csi-driver` has no way to arm this.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from csi_driver.main import main as driver_main
from csi_driver.transfer.moves import MOVE_STEPS


def main(argv: Sequence[str]) -> None:
    points: set[str] = set()
    rest = []
    for arg in argv:
        if arg.startswith("--failpoints="):
            points |= set(filter(None, arg.split("=", 1)[1].split(",")))
        else:
            rest.append(arg)
    if unknown := points - set(MOVE_STEPS.points):
        raise SystemExit(f"unknown failpoints {sorted(unknown)}; known: {', '.join(MOVE_STEPS.points)}")

    def hook(point: str) -> None:
        if point in points:
            os.kill(os.getpid(), signal.SIGKILL)

    MOVE_STEPS.install(hook)
    driver_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
