"""controller_runtime.version stands in for importlib.metadata's lookup (2.5 MiB per process,
issue 49): it must say what pyproject.toml says."""

from __future__ import annotations

import tomllib

from controller_runtime.toolchain import REPO_ROOT
from controller_runtime.version import VERSION


def test_the_version_is_pyprojects() -> None:
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["version"] == VERSION
