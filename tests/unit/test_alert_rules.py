"""deploy/prometheus: the alerting rules are valid, and each fires on what it is written for and not
on what it must leave alone (`promtool test rules`, Prometheus's own rule evaluation). promtool is
built through the Go module proxy (`make prometheus-deps`); without it this fails, never skips."""

from __future__ import annotations

import subprocess

import yaml

from controller_runtime.toolchain import REPO_ROOT, Toolchain

RULES = REPO_ROOT / "deploy" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = Toolchain.default().binary("promtool")
    return subprocess.run([str(tool), *args], capture_output=True, text=True, cwd=RULES, timeout=120)


def test_the_rules_are_valid_and_each_one_is_tested() -> None:
    checked = promtool("check", "rules", "kubeloop-alerts.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = {
        r["alert"]
        for g in yaml.safe_load((RULES / "kubeloop-alerts.yaml").read_text())["groups"]
        for r in g["rules"]
    }
    tests = yaml.safe_load((RULES / "kubeloop-alerts.test.yaml").read_text())["tests"]
    fired = {t["alertname"] for test in tests for t in test["alert_rule_test"] if t["exp_alerts"]}
    assert fired == rules, f"rules without a test that fires them: {sorted(rules - fired)}"


def test_promtool_test_rules_passes() -> None:
    tested = promtool("test", "rules", "kubeloop-alerts.test.yaml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
