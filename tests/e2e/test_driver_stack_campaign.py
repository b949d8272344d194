"""The stack campaign (issue 48; docs/driver-bench.md, "The stack campaign"): the bench's faults
injected through its proxy in front of the plugins of `make up DRIVER=`, so kubeloop's sidecars and
node agent make the calls and retry them, and the verdict is Kubernetes': the pods Running, the data
read back by a second pod, nothing stuck or leaked after the claim's deletion. On the buggy test
driver with no bug two scenarios run clean; with `memory-state` on, a kill -9 after CreateVolume
makes the provisioner's retry create a second volume and leak the first, which the inventory oracle
finds and whose reproducer `replay` reproduces against the driver alone."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from driver_bench import stack_campaign
from driver_bench.faults import Fault, FaultKind
from driver_bench.recipe import load
from driver_bench.reproducer import replay
from localstack.testing import free_stack_ports
from tests.csi.conftest import require_root
from tests.driver_bench.recipes import BUGGY, buggy_recipe

from .stacks import toolchain

pytestmark = [pytest.mark.integration, pytest.mark.root]


def options(out: Path) -> stack_campaign.StackOptions:
    toolchain()  # a missing binary fails here, with how to build it
    p = free_stack_ports()
    ports = (
        f"--apiserver-port={p.apiserver}",
        f"--etcd-port={p.etcd_client}",
        f"--etcd-peer-port={p.etcd_peer}",
        f"--kcm-port={p.kube_controller_manager}",
        f"--scheduler-port={p.kube_scheduler}",
    )
    return stack_campaign.StackOptions(out=out, launcher_args=ports)


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
    # The reproducer holds the stack's calls; against the driver alone they leak the same way.
    replayed = asyncio.run(replay(Path(scenario["reproducer"]), tmp_path / "replay"))
    assert replayed.reproduced, replayed.findings
