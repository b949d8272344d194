"""The stack campaign (issue 48; docs/driver-bench.md, "The stack campaign"): the bench's faults
injected through its proxy in front of the plugins of `make up DRIVER=`, so kubeloop's sidecars and
node agent make the calls and retry them, and the verdict is Kubernetes': the pods Running, the data
read back by a pod on the other node, nothing stuck or leaked after the claim's deletion. On the
buggy test driver with no bug two scenarios run clean; with `memory-state` on, a kill -9 after
CreateVolume makes the provisioner's retry create a second volume and leak the first, which the
inventory oracle finds, the same scenario with upstream's Go sidecars finds again (the driver's
bug, not kubeloop's sidecars'), and whose reproducer `replay` reproduces against the driver alone.
kubeloop's own driver runs the whole scenario (expansion, snapshot, restore) clean under faults in
those steps."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from controller_runtime.mounts import read_mounts
from controller_runtime.toolchain import REPO_ROOT
from driver_bench import stack_campaign
from driver_bench.faults import Fault, FaultKind, step_of
from driver_bench.recipe import load
from driver_bench.reproducer import replay
from localstack.pools import NODE_LOCAL, SHARED, PoolMode
from localstack.testing import free_stack_ports
from tests.csi.conftest import require_root
from tests.driver_bench.recipes import BUGGY, KUBELOOP, KUBELOOP_NODE_LOCAL, buggy_recipe
from tests.support.waits import eventually

from .stacks import toolchain

pytestmark = [pytest.mark.integration, pytest.mark.root]


def options(out: Path, nodes: int = 2, pools: PoolMode = SHARED) -> stack_campaign.StackOptions:
    toolchain()  # a missing binary fails here, with how to build it
    p = free_stack_ports()
    ports = (
        f"--apiserver-port={p.apiserver}",
        f"--etcd-port={p.etcd_client}",
        f"--etcd-peer-port={p.etcd_peer}",
        f"--kcm-port={p.kube_controller_manager}",
        f"--scheduler-port={p.kube_scheduler}",
    )
    return stack_campaign.StackOptions(out=out, launcher_args=ports, nodes=nodes, pools=pools)


def test_the_correct_driver_runs_clean_under_faults_through_the_stack(tmp_path: Path) -> None:
    require_root()
    faults = [Fault(FaultKind.KILL_AFTER, "NodeStageVolume"), Fault(FaultKind.DUPLICATE, "CreateVolume")]
    outcome = asyncio.run(stack_campaign.run(load(BUGGY), options(tmp_path), faults))
    report = outcome.report_md.read_text()
    assert outcome.findings == 0, report
    for r in outcome.results:
        assert r.fired, f"{r.name}: the fault never fired\n{report}"
        # Both pods ran: the data was written through the first and read back through the second.
        assert [d.kind for d in r.data] == ["write", "verify"], r.data
        # The calls are the stack's: the provisioner's, the attacher's and the node agent's.
        steps = {c.method.rsplit("/", 1)[-1] for c in r.calls}
        assert {"CreateVolume", "ControllerPublishVolume", "NodePublishVolume", "DeleteVolume"} <= steps


def test_a_driver_that_forgets_on_restart_leaks_through_the_stack(tmp_path: Path) -> None:
    require_root()
    recipe = load(buggy_recipe(tmp_path, "memory-state"))
    fault = Fault(FaultKind.KILL_AFTER, "CreateVolume")
    outcome = asyncio.run(stack_campaign.run(recipe, options(tmp_path / "out"), [fault]))
    report = json.loads(outcome.report_json.read_text())
    [scenario] = report["scenarios"]
    kinds = [f["kind"] for f in scenario["findings"]]
    assert kinds == ["leaked-volume"], report
    assert "work done before the kill was forgotten" in scenario["findings"][0]["headline"], report
    # The second opinion: the Go sidecars' provisioner, retrying the same way, leaks it too.
    assert scenario["findings"][0]["bug_of"] == stack_campaign.DRIVER_VERDICT, report
    rerun = outcome.report_md.parent / "scenarios" / f"{scenario['name']}-go-sidecars" / "stack.stdout"
    assert "upstream's Go sidecars" in rerun.read_text(), rerun
    # The reproducer holds the stack's calls; against the driver alone they leak the same way.
    replayed = asyncio.run(replay(Path(scenario["reproducer"]), tmp_path / "replay"))
    assert replayed.reproduced, replayed.findings


def test_kubeloops_driver_expands_snapshots_and_restores_under_faults_through_the_stack(
    tmp_path: Path,
) -> None:
    require_root()
    faults = [
        Fault(FaultKind.KILL_AFTER, "NodeExpandVolume"),
        Fault(FaultKind.DUPLICATE, "CreateVolumeFromSnapshot"),
    ]
    outcome = asyncio.run(stack_campaign.run(load(KUBELOOP), options(tmp_path), faults))
    report = outcome.report_md.read_text()
    assert outcome.findings == 0, report
    for r in outcome.results:
        assert r.fired, f"{r.name}: the fault never fired\n{report}"
        # Written on node-a, read back on node-b and from the claim restored from its snapshot.
        assert [d.kind for d in r.data] == ["write", "verify", "verify"], r.data
        assert any("/nodes/node-b/" in d.path for d in r.data), r.data
        steps = {step_of(c.method, c.request) for c in r.calls}
        wanted = {"ControllerExpandVolume", "NodeExpandVolume", "CreateSnapshot", "CreateVolumeFromSnapshot"}
        assert wanted | {"DeleteSnapshot", "DeleteVolume"} <= steps, steps


def test_node_local_pools_on_a_recipe_keep_each_volume_on_its_node(tmp_path: Path) -> None:
    """`make up POOLS=node-local DRIVER=`: one instance of the recipe's command per node on the
    node's own backend, each node's provisioner creating the volumes the scheduler placed there
    (WaitForFirstConsumer, the topology NodeGetInfo reports), snapshots taken by that node's
    csi-snapshotter, the restore made in the same pool."""
    require_root()
    fault = Fault(FaultKind.KILL_AFTER, "CreateVolume")
    outcome = asyncio.run(
        stack_campaign.run(load(KUBELOOP_NODE_LOCAL), options(tmp_path, pools=NODE_LOCAL), [fault])
    )
    report = outcome.report_md.read_text()
    assert outcome.findings == 0, report
    [r] = outcome.results
    assert r.fired, report
    assert [d.kind for d in r.data] == ["write", "verify", "verify"], r.data
    # Every call reached node-a's plugin (the pods' node), none node-b's: no controller instance.
    logs = outcome.report_md.parent / "scenarios" / r.name
    assert "CreateSnapshot" in (logs / "csi-driver-node-node-a-calls.jsonl").read_text()
    assert "CreateVolume" not in (logs / "csi-driver-node-node-b-calls.jsonl").read_text()
    assert not (logs / "csi-driver-controller-calls.jsonl").exists()


def test_a_campaign_killed_mid_scenario_leaves_no_stack_running(tmp_path: Path) -> None:
    """kill -9 of the campaign while its stack runs: the launcher, told by the kernel (its parent
    death signal), stops in order, so the next campaign finds the ports free and nothing mounted."""
    require_root()
    toolchain()
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "driver_bench.main", "stack-campaign", f"--recipe={BUGGY}", f"--out={out}",
        "--steps=CreateVolume", "--faults=kill-after", "--sidecars=kubeloop", "--nodes=1",
    ]  # fmt: skip
    campaign = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    launchers: list[psutil.Process] = []
    try:
        stdout = out / "scenarios" / "s00-baseline" / "stack.stdout"

        def ready() -> str | None:
            text = stdout.read_text() if stdout.exists() else ""
            return text if stack_campaign.READY_LINE in text else None

        eventually("the scenario's stack ready", ready, 240, 0.5)
        launchers += [
            p
            for p in psutil.process_iter(["cmdline"])
            if "localstack.main" in " ".join(p.info["cmdline"] or [])
        ]
        assert launchers, "no launcher found"
    finally:
        campaign.kill()
        campaign.wait()
    _, alive = psutil.wait_procs(launchers, timeout=90)
    assert not alive, f"launchers still running after the campaign's kill: {alive}"
    assert "kubeloop: stopped" in stdout.read_text(), stdout.read_text()
    left = [m.mountpoint for m in read_mounts() if m.mountpoint.startswith("/tmp/kls-")]
    assert not left, left
