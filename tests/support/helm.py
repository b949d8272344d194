"""The Helm chart deploy/helm/kubeloop as the tests render it: the pinned helm (`tool`; a test fails,
never skips, when it is missing), `helm_template` with values set, and the rendered documents by
(kind, namespace, name) (`objects`)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller_runtime.toolchain import REPO_ROOT, MissingBinaryError, Toolchain

CHART = REPO_ROOT / "deploy" / "helm" / "kubeloop"
KUBELOOP = "storageControllers=kubeloop"
NAMESPACE = "kube-system"

Key = tuple[str, str, str]


def tool(name: str) -> str:
    try:
        return str(Toolchain.default().binary(name))
    except MissingBinaryError as e:
        pytest.fail(str(e))


def run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        list(args), capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False
    )
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def helm_template(
    *values: str,
    check: bool = True,
    files: Sequence[Path] = (),
    chart: Path = CHART,
    flags: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    args = [a for f in files for a in ("--values", str(f))] + [a for v in values for a in ("--set", v)]
    return run(
        [tool("helm"), "template", "kubeloop", str(chart), "--namespace", NAMESPACE, *flags, *args],
        check=check,
    )


def objects(text: str) -> dict[Key, dict[str, Any]]:
    out: dict[Key, dict[str, Any]] = {}
    for doc in yaml.safe_load_all(text):
        if doc:
            key = (doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])
            assert key not in out, f"{key} rendered twice"
            out[key] = doc
    return out
