"""Fault injection stays out of the shipped processes: no environment variable arms a failpoint in
the provisioner, only the test-only entry module installs the kill hook."""

from __future__ import annotations

import os
import subprocess
import sys

from controller_runtime.toolchain import REPO_ROOT

from ..source_tree import offenders

REACH_ALL = (
    "from external_provisioner import failpoints\n"
    "for p in failpoints.POINTS:\n"
    "    failpoints.reach(p)\n"
    "print('alive')\n"
)


def test_environment_cannot_arm_failpoints_in_the_shipped_provisioner() -> None:
    env = {
        **os.environ,
        "KUBELOOP_PROVISIONER_FAILPOINTS": "before-create-volume,after-create-volume,after-pv-saved",
    }
    proc = subprocess.run(
        [sys.executable, "-c", REACH_ALL], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout.strip()) == (0, "alive"), proc.stderr


def test_no_shipped_module_reads_failpoints_from_the_environment() -> None:
    assert offenders("FAILPOINT") == []


def test_the_test_entry_module_kills_at_the_named_step() -> None:
    code = (
        "from external_provisioner import failpoints\n"
        "from tests.integration.provisioner_failpoints import kill_at\n"
        "failpoints.install(kill_at({'after-create-volume'}))\n"
        "failpoints.reach('before-create-volume')\n"
        "print('passed the first step', flush=True)\n"
        "failpoints.reach('after-create-volume')\n"
        "print('not reached')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -9 and proc.stdout.strip() == "passed the first step", (
        proc.stdout,
        proc.stderr,
    )
