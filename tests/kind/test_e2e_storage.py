"""A few minutes of Kubernetes' own external-storage e2e suite (e2e.test) against kubeloop in the kind
cluster of this package: the `quick` selection of localstack/e2e_storage.py, one spec of each thing
kubeloop does with a real kubelet (provisioning, data, block mode, clone, snapshot restore, offline
expansion, topology, capacity). `make e2e-storage` runs the whole suite (docs/e2e-storage.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from controller_runtime.toolchain import REPO_ROOT, Toolchain
from localstack.e2e_storage import QUICK_SPECS

from .conftest import KindCluster


def test_quick_external_storage_specs_pass(kind_cluster: KindCluster, tmp_path: Path) -> None:
    e2e_test = Toolchain.default().binary("e2e.test")
    if not e2e_test.exists():
        pytest.fail(f"{e2e_test} is missing: run `bash tools/build-binaries.sh e2e` (make test does)")
    cluster = kind_cluster.cluster
    result = subprocess.run(
        [
            sys.executable, "-m", "localstack.e2e_storage", "run", "--suite", "quick",
            f"--results={tmp_path}", f"--kubeconfig={cluster.kubeconfig}", f"--name={cluster.name}",
        ],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    summary_file = tmp_path / "summary.json"
    assert summary_file.exists(), f"no summary (exit {result.returncode}):\n{result.stderr[-4000:]}"
    summary = json.loads(summary_file.read_text())
    counts = f"{summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped"
    print(f"\ne2e quick: {counts} in {summary['seconds']:.0f}s")
    log_tail = (tmp_path / "e2e.log").read_text()[-6000:] if (tmp_path / "e2e.log").exists() else ""
    assert summary["failed"] == 0 and not summary["suite_failures"], (summary["failures"], log_tail)
    # Every selected spec ran (the ROX clone skips itself: a loop device lives on one node).
    assert summary["passed"] >= len(QUICK_SPECS), (summary, log_tail)
    assert result.returncode == 0, result.stderr[-4000:]
