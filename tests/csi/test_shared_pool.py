"""The local stack starts the controller-mode driver and one node-mode driver per node on one pool
at the same moment. Real processes, launched together, round after round on the same directories
(each round is also a restart): every one must become ready and stop cleanly.

`KUBELOOP_POOL_START_ROUNDS` sets the number of rounds (default 10; `make stress-start` runs 50).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .conftest import Driver

ROUNDS = int(os.environ.get("KUBELOOP_POOL_START_ROUNDS", "10"))
NODES = 3


def test_controller_and_node_drivers_started_together_all_become_ready(csi_root: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="sp", dir=csi_root))
    pool = base / "pool"
    failures: list[str] = []
    for round_ in range(ROUNDS):
        drivers = [Driver(base / "c", "controller", pool=pool)] + [
            Driver(base / f"n{i}", "node", node_id=f"node-{i}", pool=pool) for i in range(NODES)
        ]
        for d in drivers:
            d.root.mkdir(exist_ok=True)
            d.launch()
        try:
            for d in drivers:
                try:
                    d.wait_ready(60)
                except RuntimeError as e:
                    failures.append(f"round {round_}, {d.mode} {d.node_id}: {e}")
        finally:
            codes = [d.stop() for d in drivers]
        if any(codes):
            failures.append(f"round {round_}: exit codes {codes}")
    print(f"{ROUNDS} rounds of 1 controller + {NODES} node drivers on one pool: {len(failures)} failed")
    assert not failures, "\n".join(failures)
    # Nothing with a shared fixed name is left in the pool, and no temporary file either.
    assert sorted(p.name for p in pool.iterdir()) == [
        ".budget.lock",
        ".controller.lock",
        "budget.json",
        "ephemeral",
        "freezes",
        "nodes",
        "snapshots",
        "volumes",
    ]
    assert sorted(p.name for p in (pool / "nodes").iterdir()) == [f"node-{i}.json" for i in range(NODES)]
