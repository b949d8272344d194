"""A container's arguments as kubelet hands them over."""

from __future__ import annotations

import re

_REFERENCE = re.compile(r"\$\((\w+)\)")


def expand(arg: str, env: dict[str, str]) -> str:
    """kubelet's $(VAR) expansion of a container's args from its env (unknown ones stay as written)."""
    return _REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), arg)
