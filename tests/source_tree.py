"""The repository's own shipped Python code, as pyproject.toml lists it for the wheel: what the
source checks (no umask, no failpoints read from the environment) scan, so a new package is
covered by adding it there once."""

from __future__ import annotations

import re
import tomllib

from controller_runtime.toolchain import REPO_ROOT

GENERATED = "kubeloop_grpc"


def shipped_packages() -> list[str]:
    find = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return [p.rstrip("*") for p in find["include"] if p.rstrip("*") != GENERATED]


def offenders(pattern: str) -> list[str]:
    """Shipped files (relative paths) whose text matches the regular expression `pattern`."""
    found = []
    for package in shipped_packages():
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if re.search(pattern, path.read_text()):
                found.append(str(path.relative_to(REPO_ROOT)))
    return found
