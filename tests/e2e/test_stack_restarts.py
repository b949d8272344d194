"""The whole stack (`python -m localstack.main up`) started and stopped again and again on one
home, as a user restarting `make up` does: every start must reach ready, every SIGTERM must stop
everything with exit 0 and leave no process behind.

`KUBELOOP_STACK_ROUNDS` sets the number of rounds (default 3; `make stress-start` runs 20).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

from .stacks import cleanup, launch, short_home, stack_processes

ROUNDS = int(os.environ.get("KUBELOOP_STACK_ROUNDS", "3"))


def test_stack_starts_and_stops_every_round(tmp_path: Path) -> None:
    failures: list[str] = []
    with short_home() as home:
        for round_ in range(ROUNDS):
            base = tmp_path / str(round_)
            base.mkdir()
            try:
                running = launch(home, base)
            except BaseException as e:  # pytest.fail inside launch: record it and go on
                failures.append(f"round {round_}: not ready: {str(e)[-3000:]}")
                continue
            try:
                running.proc.send_signal(signal.SIGTERM)
                code = running.proc.wait(90)
                _gone, alive = psutil.wait_procs(running.children, timeout=10)
                if code != 0 or alive or stack_processes(home):
                    failures.append(f"round {round_}: exit {code}, left {[p.pid for p in alive]}")
            finally:
                cleanup(running)
    print(f"{ROUNDS} stack start/stop rounds: {len(failures)} failed")
    assert not failures, "\n".join(failures)
