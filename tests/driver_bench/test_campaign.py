"""The driver bench end to end (docs/driver-bench.md): kubeloop's own driver through its recipe
runs the whole sweep clean; the buggy driver's five bugs are each found by the campaign, named,
and replayed from the reproducer against the driver alone (and not with the bug switched off).
Needs root, loop devices and mount, like tests/csi: without them the tests fail, never skip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from driver_bench import campaign
from driver_bench.diagnosis import headline
from driver_bench.faults import Fault, FaultKind
from driver_bench.recipe import load
from driver_bench.reproducer import replay
from localstack.leftovers import find_leftovers
from tests.csi.conftest import require_root

from .recipes import KUBELOOP, buggy_recipe, write_recipe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def root() -> None:
    require_root()


async def test_kubeloop_runs_the_whole_sweep_clean(tmp_path: Path) -> None:
    # Two lifecycles at once: a kill lands while the other's call is in flight (the sweep found two
    # bugs of the node service that way, tests/csi/test_interrupted_stage.py).
    options = campaign.Options(out=tmp_path / "out", concurrency=2, parallel=2)
    outcome = await campaign.run(load(KUBELOOP), options)
    findings = {r.name: [str(f) for f in r.findings] for r in outcome.results if r.findings}
    assert not findings, findings
    # The baseline and every fault on every step (the restore's CreateVolume among them) ran and fired.
    assert len(outcome.results) == 1 + len(FaultKind) * 13
    assert all(r.fired for r in outcome.results if r.fault), [r.name for r in outcome.results if not r.fired]
    report = json.loads(outcome.report_json.read_text())
    assert {t["method"] for t in report["timings"]} >= {"CreateVolume", "NodeStageVolume", "DeleteSnapshot"}
    assert "| s00-baseline |" in outcome.report_md.read_text()
    assert not find_leftovers(tmp_path)


async def test_the_correct_buggy_driver_runs_clean_under_duplicates(tmp_path: Path) -> None:
    """The buggy driver with no bug: two lifecycles at once, each step's call duplicated, find
    nothing, so what the tests below find is the bug and not the bench."""
    options = campaign.Options(out=tmp_path / "out", concurrency=2, parallel=2, kinds=(FaultKind.DUPLICATE,))
    outcome = await campaign.run(load(buggy_recipe(tmp_path, "")), options)
    assert not outcome.findings, [(r.name, r.findings) for r in outcome.results if r.findings]


# Each bug, the fault that reveals it, the finding it is named by and words of its headline.
BUGS = [
    ("duplicate-create", Fault(FaultKind.DUPLICATE, "CreateVolume"), "leaked-volume", "not idempotent"),
    ("memory-state", Fault(FaultKind.KILL_AFTER, "ControllerPublishVolume"), "call-failed", "state lost"),
    ("republish-fails", Fault(FaultKind.DROP, "NodePublishVolume"), "call-failed", "not idempotent"),
    (
        "delete-timeout-leak",
        Fault(FaultKind.TIMEOUT, "DeleteVolume"),
        "leaked-volume",
        "cut off by its deadline",
    ),
    ("unstage-leaves-mount", None, "leftover-mount", "mounts left behind"),
]


@pytest.mark.parametrize(("bug", "fault", "kind", "name"), BUGS, ids=[b[0] for b in BUGS])
async def test_each_bug_is_found_and_replays_alone(
    tmp_path: Path, bug: str, fault: Fault | None, kind: str, name: str
) -> None:
    recipe = load(buggy_recipe(tmp_path, bug))
    outcome = await campaign.run(recipe, campaign.Options(out=tmp_path / "out"), faults=[fault])
    (result,) = outcome.results
    assert [f.kind for f in result.findings] == [kind], result.findings
    assert name in headline(fault, result.findings[0]), headline(fault, result.findings[0])
    assert result.reproducer is not None and result.reproducer.exists()
    doc = json.loads(result.reproducer.read_text())
    assert doc["fault"] == (fault.to_json() if fault else None)
    assert doc["calls"][0]["method"].startswith("/csi.v1.") and "request" in doc["calls"][0]
    assert str(result.reproducer) in outcome.report_md.read_text()

    again = await replay(result.reproducer, tmp_path / "replay")
    assert again.reproduced, again.findings
    assert not find_leftovers(tmp_path)

    # The same calls against the driver with the bug switched off: the finding is the bug's.
    doc["recipe"] = str(buggy_recipe(tmp_path / "fixed", ""))
    fixed = tmp_path / "fixed.json"
    fixed.write_text(json.dumps(doc))
    clean = await replay(fixed, tmp_path / "replay-fixed")
    assert not clean.reproduced and not clean.findings, clean.findings


async def test_a_separate_node_plugin_is_killed_and_restarted_alone(tmp_path: Path) -> None:
    """A recipe with a node command: Node calls go to that process, and a kill on a Node step
    kills and restarts it alone (the controller's log shows one start, the node's two)."""
    doc = yaml.safe_load(buggy_recipe(tmp_path, "").read_text())
    doc["node"] = {"command": list(doc["controller"]["command"])}
    recipe = load(write_recipe(tmp_path / "split.yaml", doc))
    faults = [Fault(FaultKind.KILL_BEFORE, "NodeStageVolume"), Fault(FaultKind.KILL_AFTER, "CreateVolume")]
    outcome = await campaign.run(recipe, campaign.Options(out=tmp_path / "out"), faults=faults)
    assert not outcome.findings, [r.findings for r in outcome.results]
    node_kill, controller_kill = (r.work for r in outcome.results)
    starts = {
        (work.name, role): (work / f"{role}.log").read_text().count("--- start")
        for work in (node_kill, controller_kill)
        for role in ("controller", "node")
    }
    assert starts == {
        (node_kill.name, "controller"): 1,
        (node_kill.name, "node"): 2,
        (controller_kill.name, "controller"): 2,
        (controller_kill.name, "node"): 1,
    }
