"""Test-only entry point: the real external-provisioner with a failpoint hook installed.

    python -m tests.integration.provisioner_failpoints --failpoints=after-create-volume [provisioner flags]

SIGKILLs the process the first time it reaches one of the named steps, exactly like `kill -9` at
that line. The shipped `kubeloop-external-provisioner` has no way to arm this.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from controller_runtime.logs import get_logger
from external_provisioner import failpoints
from external_provisioner.main import main as provisioner_main
from tests.support.failpoint_entry import kill_at as killing_at
from tests.support.failpoint_entry import take_failpoints

log = get_logger("external-provisioner")


def kill_at(points: set[str]) -> failpoints.Hook:
    unknown = points - set(failpoints.POINTS)
    if unknown:
        raise SystemExit(f"unknown failpoints {sorted(unknown)}; known: {', '.join(failpoints.POINTS)}")
    return killing_at(
        points, lambda point: log.warning("failpoint reached, killing the process", failpoint=point)
    )


def main(argv: Sequence[str]) -> None:
    points, rest = take_failpoints(argv, failpoints.POINTS)
    failpoints.install(kill_at(points))
    provisioner_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
