"""Recipes the driver-bench tests run: the buggy driver's with one bug switched on (a copy of
tests/driver_bench/buggy.yaml whose env names it), and bad ones written out for a test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
BUGGY = HERE / "buggy.yaml"
KUBELOOP = HERE.parent.parent / "driver_bench" / "recipes" / "kubeloop.yaml"  # kubeloop's own driver
KUBELOOP_NODE_LOCAL = KUBELOOP.with_name("kubeloop-node-local.yaml")  # the same, each node its own pool


def buggy_recipe(directory: Path, bug: str) -> Path:
    doc: dict[str, Any] = yaml.safe_load(BUGGY.read_text())
    doc["env"] = {"BUGGY_DRIVER_BUG": bug}
    return write_recipe(directory / f"buggy-{bug or 'none'}.yaml", doc)


def write_recipe(path: Path, doc: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path
