"""Test-only entry point: the real external-provisioner with a failpoint hook installed.

    python -m tests.integration.provisioner_failpoints --failpoints=after-create-volume [provisioner flags]

SIGKILLs the process the first time it reaches one of the named steps, exactly like `kill -9` at
that line. The shipped `kubeloop-external-provisioner` has no way to arm this.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from controller_runtime.logs import get_logger
from external_provisioner import failpoints
from external_provisioner.main import main as provisioner_main

log = get_logger("external-provisioner")


def kill_at(points: set[str]) -> failpoints.Hook:
    unknown = points - set(failpoints.POINTS)
    if unknown:
        raise SystemExit(f"unknown failpoints {sorted(unknown)}; known: {', '.join(failpoints.POINTS)}")

    def hook(point: str) -> None:
        if point in points:
            log.warning("failpoint reached, killing the process", failpoint=point)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def main(argv: Sequence[str]) -> None:
    points: set[str] = set()
    rest = []
    for arg in argv:
        if arg.startswith("--failpoints="):
            points |= set(filter(None, arg.split("=", 1)[1].split(",")))
        else:
            rest.append(arg)
    failpoints.install(kill_at(points))
    provisioner_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
