"""A bounded chaos campaign in `make test` (a few rounds, a few minutes): kill -9 of every kind of
kubeloop process, an apiserver and an etcd restart, a controller paused past its lease, the leader
of two replicas killed, a full pool, all during a workload of claims, pods, moves and expansions;
after each round the invariants must hold with no leak, no corruption and no double attachment.
`make chaos` runs the long campaign (docs/chaos.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .campaign import campaign
from .driver import KINDS, ChaosConfig

pytestmark = [pytest.mark.integration, pytest.mark.root]

ROUNDS = int(os.environ.get("KUBELOOP_CHAOS_ROUNDS", "3"))


async def test_chaos_rounds_converge(tmp_path: Path) -> None:
    config = ChaosConfig(
        rounds=ROUNDS,
        kills_per_round=4,
        apiserver_every=2,
        etcd_every=3,
        pause_every=2,
        fill_every=3,
        claims_per_round=2,
        replicas=2,
        leader_kill_every=2,
        seed=int(os.environ.get("KUBELOOP_CHAOS_SEED", "7")),
        report_path=tmp_path / "chaos-report.json",
    )
    report = await campaign(config, tmp_path / "cp")
    t = report.totals()
    assert not t["failures"], "\n".join(t["failures"])
    assert t["leaked"] == {"files": 0, "devices": 0, "mounts": 0, "finalizers": 0, "attachments": 0}
    assert t["corruptions"] == 0 and t["double_attachments"] == 0
    leader_kills = ROUNDS // 2
    assert t["kills"] == ROUNDS * 4 + leader_kills and set(t["kills_by_kind"]) <= set(KINDS)
    assert t["leader_takeovers"] == leader_kills
    if ROUNDS >= 3:
        assert t["apiserver_restarts"] >= 1 and t["etcd_restarts"] >= 1 and t["refused_claims"] >= 1
    assert t["invariant_checks_passed"] >= ROUNDS * 8
    assert (tmp_path / "chaos-report.json").exists()
