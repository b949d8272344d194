"""Test-only entry point: the real CSI driver with a failpoint hook installed.

    python -m tests.csi.driver_failpoints --failpoints=move-after-pull [driver flags]

SIGKILLs the process the first time it reaches one of the named steps
(csi_driver.transfer.moves.MOVE_STEPS), exactly like `kill -9` at that line. The shipped
`kubeloop-csi-driver` has no way to arm this.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from csi_driver.main import main as driver_main
from csi_driver.transfer.moves import MOVE_STEPS
from tests.support.failpoint_entry import kill_at, take_failpoints


def main(argv: Sequence[str]) -> None:
    points, rest = take_failpoints(argv, MOVE_STEPS.points)
    MOVE_STEPS.install(kill_at(points))
    driver_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
