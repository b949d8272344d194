"""localstack/e2e_storage.py: the e2e.test command line, the count of a Ginkgo JUnit report, and the
driver file the suite reads (deploy/kind/e2e-driver.yaml) against what the driver really offers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import csi_driver
from controller_runtime.toolchain import REPO_ROOT
from csi_driver.backend.fs import SUPPORTED
from localstack import e2e_storage
from localstack.e2e_storage import Options, command, duration_seconds, parse_junit

# The shape of Ginkgo v2's report: specs the filters left out are skipped without a reason, specs that
# skip themselves carry one, and the suite's own nodes have names without [It].
REPORT = """<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="7" disabled="3" errors="0" failures="1" time="12.5">
  <testsuite name="Kubernetes e2e suite" package="/x" tests="7" skipped="3" failures="1">
    <testcase name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="passed" time="1"/>
    <testcase name="[It] External Storage [Driver: loop.csi.kubeloop.dev] provisioning should provision"
              classname="Kubernetes e2e suite" status="passed" time="3"/>
    <testcase name="[It] External Storage [Driver: loop.csi.kubeloop.dev] volumes should store data"
              classname="Kubernetes e2e suite" status="failed" time="4">
      <failure type="failed">timed out</failure>
    </testcase>
    <testcase name="[It] External Storage [Driver: loop.csi.kubeloop.dev] snapshot should restore"
              classname="Kubernetes e2e suite" status="skipped" time="0.1">
      <skipped message="skipped - Driver loop.csi.kubeloop.dev does not support snapshots"/>
    </testcase>
    <testcase name="[It] External Storage [Driver: loop.csi.kubeloop.dev] [Slow] stress"
              classname="Kubernetes e2e suite" status="skipped" time="0">
      <skipped message="skipped"/>
    </testcase>
    <testcase name="[It] [sig-node] Pods should run" classname="Kubernetes e2e suite" status="skipped">
      <skipped message="skipped"/>
    </testcase>
    <testcase name="[ReportAfterSuite] Kubernetes e2e JUnit report" classname="Kubernetes e2e suite"
              status="passed" time="0"/>
  </testsuite>
</testsuites>
"""


def test_junit_counts_specs_and_tells_runtime_skips_from_filtered_ones(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(REPORT)
    s = parse_junit(report)
    assert (s.passed, s.failed, s.skipped, s.not_selected) == (1, 1, 1, 2)
    assert s.line() == "1 passed, 1 failed, 1 skipped"
    assert s.failures == ["External Storage [Driver: loop.csi.kubeloop.dev] volumes should store data"]
    assert len(s.selected_specs) == 3
    assert not s.ok


def test_a_failed_suite_node_is_a_failure_of_the_run(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(
        REPORT.replace('name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="passed"',
                       'name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="failed"')
    )  # fmt: skip
    s = parse_junit(report)
    assert s.suite_failures == ["[SynchronizedBeforeSuite]"]
    assert "suite setup or teardown failed" in s.line()
    assert not s.ok


def test_command_line(tmp_path: Path) -> None:
    o = Options(e2e_test=Path("/bin/e2e.test"), results=tmp_path, kubeconfig=Path("/k"), kubectl=Path("/kc"))
    argv = command(o)
    assert argv[0] == "/bin/e2e.test"
    assert "-provider=skeleton" in argv
    assert "-kubeconfig=/k" in argv and "-kubectl-path=/kc" in argv
    assert f"-storage.testdriver={e2e_storage.DRIVER_FILE}" in argv
    assert f"-kube-test-repo-list={e2e_storage.REPO_LIST}" in argv
    assert f"-ginkgo.junit-report={tmp_path / 'junit.xml'}" in argv
    assert "-ginkgo.focus=External.Storage" in argv
    assert "-ginkgo.skip=Disruptive|Serial|Slow" in argv
    assert "-ginkgo.dry-run" not in argv
    o.dry_run = True
    assert "-ginkgo.dry-run" in command(o)


def test_suites_select_with_go_regexps() -> None:
    quick = e2e_storage.SUITES["quick"].focus
    assert "\\ " not in quick  # RE2 refuses an escaped space
    assert e2e_storage.go_regexp_quote("[Testpattern: Dynamic PV (default fs)]") == (
        "\\[Testpattern: Dynamic PV \\(default fs\\)\\]"
    )
    assert "-ginkgo.skip=" not in " ".join(
        command(e2e_storage.Options(e2e_test=Path("e2e.test"), results=Path("r"), skip=""))
    )


@pytest.mark.parametrize(("text", "seconds"), [("3h", 10800), ("90m", 5400), ("1h30m", 5400), ("45s", 45)])
def test_durations(text: str, seconds: float) -> None:
    assert duration_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "3", "h", "3d", "-1h"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        duration_seconds(text)


def test_driver_file_matches_the_driver() -> None:
    doc = yaml.safe_load((REPO_ROOT / "deploy" / "kind" / "e2e-driver.yaml").read_text())
    info = doc["DriverInfo"]
    assert info["Name"] == e2e_storage.DRIVER_NAME
    csidriver = yaml.safe_load((REPO_ROOT / "deploy" / "csidriver.yaml").read_text())
    assert csidriver["metadata"]["name"] == info["Name"]
    assert info["TopologyKeys"] == [csi_driver.TOPOLOGY_KEY]
    assert set(info["SupportedFsType"]) <= set(SUPPORTED)
    assert doc["StorageClass"] == {"FromName": True}
    # The kind cluster has the CRDs, snapshot-controller and csi-snapshotter (deploy/, localstack/kind.py).
    assert info["Capabilities"]["snapshotDataSource"] is True
    assert doc["SnapshotClass"] == {"FromName": True}
    assert all(v is True for v in info["Capabilities"].values())
