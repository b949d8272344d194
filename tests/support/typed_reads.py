"""The string-keyed reads of `spec`, `metadata` and `status` in runtime code (issue 46), as mypy
types them: every `x["spec"]` and `x.get("spec")` (and the same of `metadata` and `status`) in
the packages that ship, not in tests, bench or localstack, and whether `x` is a typed view
(`controller_runtime.kinds`, a TypedDict) or a plain dict. mypy checks a subscript read of a view
against its fields but lets `.get` take any key (PEP 589): `unknown_gets` lists the `.get` reads of
a view whose key none of its fields has, a misspelt field the lint does not catch.

The reads are found in mypy's own types of the runtime packages (one build, about ten seconds), so
what counts as typed is what mypy checks. `python -m tests.support.typed_reads` prints the counts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from mypy import build
from mypy.config_parser import parse_config_file
from mypy.find_sources import create_source_list
from mypy.nodes import CallExpr, Expression, IndexExpr, MemberExpr, StrExpr
from mypy.options import Options
from mypy.types import NoneType, Type, TypedDictType, UnionType, get_proper_type

from controller_runtime.toolchain import REPO_ROOT

KEYS = frozenset({"spec", "metadata", "status"})
# Not runtime code: the tools on top, the generated stubs.
NOT_RUNTIME = frozenset({"tests", "bench", "localstack", "kubeloop_grpc"})


def runtime_packages(root: Path = REPO_ROOT) -> list[str]:
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and (p / "__init__.py").is_file() and p.name not in NOT_RUNTIME
    )


@dataclass(frozen=True)
class Read:
    line: int
    key: str
    typed: bool  # read from a typed view (or a view or None)
    get: bool  # x.get("k"); else x["k"]
    unknown: bool  # a .get of a view whose fields do not include the key


def _views(tp: Type | None) -> list[TypedDictType] | None:
    """The TypedDicts a read's receiver is, or None when it is no view (a dict, Any, a union with
    a plain dict)."""
    if tp is None:
        return None
    proper = get_proper_type(tp)
    items = [get_proper_type(t) for t in proper.items] if isinstance(proper, UnionType) else [proper]
    views = [t for t in items if isinstance(t, TypedDictType)]
    rest = [t for t in items if not isinstance(t, TypedDictType | NoneType)]
    return views if views and not rest else None


def _read(expr: Expression, types: dict[Expression, Type]) -> Read | None:
    if isinstance(expr, IndexExpr) and isinstance(expr.index, StrExpr):
        key, receiver, get = expr.index.value, expr.base, False
    elif (
        isinstance(expr, CallExpr)
        and isinstance(expr.callee, MemberExpr)
        and expr.callee.name == "get"
        and expr.args
        and isinstance(expr.args[0], StrExpr)
    ):
        key, receiver, get = expr.args[0].value, expr.callee.expr, True
    else:
        return None
    views = _views(types.get(receiver))
    unknown = get and views is not None and any(key not in v.items for v in views)
    return Read(expr.line, key, views is not None, get, unknown)


def runtime_reads(root: Path = REPO_ROOT) -> list[Read]:
    """Every string-keyed read in the runtime packages, of any key, with mypy's verdict on its
    receiver. Line numbers only: mypy's type map does not say which file an expression is in."""
    options = Options()
    parse_config_file(options, lambda: None, str(root / "pyproject.toml"), sys.stdout, sys.stderr)
    options.incremental = False  # the map of every expression's type comes from a fresh check
    options.export_types = True
    sources = create_source_list([str(root / p) for p in runtime_packages(root)], options)
    types = build.build(sources, options).types
    return [r for expr in types if (r := _read(expr, types)) is not None]


def counts(reads: list[Read]) -> tuple[int, int]:
    """(reads of spec/metadata/status, of those through a view)."""
    ours = [r for r in reads if r.key in KEYS]
    return len(ours), sum(r.typed for r in ours)


def main() -> int:
    reads = runtime_reads()
    total, typed = counts(reads)
    print(f"{total} string-keyed reads of spec/metadata/status in runtime code")
    print(f"{typed} through a typed view, {total - typed} of a plain dict")
    unknown = sorted({r.key for r in reads if r.unknown})
    print(f".get of a view with a key it does not declare: {', '.join(unknown) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
