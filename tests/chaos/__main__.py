"""`make chaos`: a long chaos campaign. CHAOS_ROUNDS rounds of CHAOS_KILLS kills each (and the
apiserver and etcd restarts, pauses, leader kills and pool fills of every few rounds), with
CHAOS_REPLICAS replicas of each leader-elected controller (default 2); CHAOS_SEED makes a run
repeatable, CHAOS_REPORT names the JSON report (default chaos-report.json). Exits 1 when any
invariant, checksum or operation failed."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from .campaign import campaign
from .driver import ChaosConfig, Report


async def _run(config: ChaosConfig) -> Report:
    # Ctrl-C or SIGTERM cancels the campaign, so its stack is still stopped and its loop devices
    # and mounts cleaned up.
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    return await campaign(config)


def main() -> None:
    config = ChaosConfig(
        rounds=int(os.environ.get("CHAOS_ROUNDS", "40")),
        kills_per_round=int(os.environ.get("CHAOS_KILLS", "5")),
        seed=int(os.environ.get("CHAOS_SEED", "1")),
        replicas=int(os.environ.get("CHAOS_REPLICAS", "2")),
        leader_kill_every=2,
        report_path=Path(os.environ.get("CHAOS_REPORT", "chaos-report.json")).resolve(),
    )
    report = asyncio.run(_run(config))
    failures = report.totals()["failures"]
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
