"""The `quick` selection of Kubernetes' external-storage e2e suite (localstack/e2e_storage.py) run
against a kind cluster of the tests, and its summary checked: tests/kind (shared pool) and
tests/kind_local (node-local pools) run the same specs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from controller_runtime.toolchain import REPO_ROOT, Toolchain
from localstack.e2e_storage import NODE_LOCAL_E2E_CLASS, QUICK_SPECS, external_specs
from localstack.kind import Cluster


def assert_quick_specs_pass(
    cluster: Cluster, results: Path, specs: tuple[str, ...] = QUICK_SPECS, driver: Path | None = None
) -> dict[str, float]:
    """Runs `specs` (the quick selection unless told) into `results`, against the driver the e2e
    driver file `driver` describes (kubeloop's deploy/kind/e2e-driver.yaml unless told); fails unless
    every one ran and passed. Returns the counts and the seconds taken."""
    focus = [] if specs == QUICK_SPECS else ["--focus", external_specs(specs)]
    if driver is not None:
        focus += ["--driver", str(driver)]
    # Node-local pools: the specs' claims wait for their pods, as in hostpath's distributed test driver.
    if cluster.pools == "separate":
        focus += ["--storage-class", NODE_LOCAL_E2E_CLASS]
    e2e_test = Toolchain.default().binary("e2e.test")
    if not e2e_test.exists():
        pytest.fail(f"{e2e_test} is missing: run `bash tools/build-binaries.sh e2e` (make test does)")
    result = subprocess.run(
        [
            sys.executable, "-m", "localstack.e2e_storage", "run", "--suite", "quick",
            f"--results={results}", f"--kubeconfig={cluster.kubeconfig}", f"--name={cluster.name}", *focus,
        ],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    summary_file = results / "summary.json"
    assert summary_file.exists(), f"no summary (exit {result.returncode}):\n{result.stderr[-4000:]}"
    summary = json.loads(summary_file.read_text())
    counts = f"{summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped"
    print(f"\ne2e quick ({cluster.pools} pools): {counts} in {summary['seconds']:.0f}s")
    log_tail = (results / "e2e.log").read_text()[-6000:] if (results / "e2e.log").exists() else ""
    assert summary["failed"] == 0 and not summary["suite_failures"], (summary["failures"], log_tail)
    # Every selected spec ran (the ROX clone skips itself: a loop device lives on one node).
    assert summary["passed"] >= len(specs), (summary, log_tail)
    assert result.returncode == 0, result.stderr[-4000:]
    return {k: float(summary[k]) for k in ("passed", "failed", "skipped", "seconds")}
