"""The string-keyed reads of `spec`, `metadata` and `status` in runtime code (issue 46): every
`x["spec"]`, `x.get("spec")` (and the same of `metadata` and `status`) in the packages that ship,
not in tests, bench or localstack. A read counts as typed when the object it starts from is a typed
view (`controller_runtime.kinds`) in its function: a parameter annotated with a view, or a name
bound to a `*_view(...)` conversion or annotated with one. mypy checks those; the others are reads
of a plain dict.

`python -m tests.support.typed_reads` prints the counts per package.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from controller_runtime import kinds
from controller_runtime.toolchain import REPO_ROOT

KEYS = frozenset({"spec", "metadata", "status"})
# Not runtime code: the tools on top, the generated stubs.
NOT_RUNTIME = frozenset({"tests", "bench", "localstack", "kubeloop_grpc"})
VIEW_NAMES = frozenset(
    name
    for name, value in vars(kinds).items()
    if isinstance(value, type) and issubclass(value, dict) and value.__module__ == kinds.__name__
)
_VIEW_WORD = re.compile(r"\b(" + "|".join(sorted(VIEW_NAMES)) + r")\b")


def runtime_packages(root: Path = REPO_ROOT) -> list[Path]:
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and (p / "__init__.py").is_file() and p.name not in NOT_RUNTIME
    )


def string_key(node: ast.AST) -> str | None:
    """The key of `x["k"]` or `x.get("k", ...)` when it is a string literal."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        key = node.slice.value
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ):
        key = node.args[0].value
    else:
        return None
    return key if isinstance(key, str) else None


def receiver(node: ast.AST) -> ast.AST:
    """What a read reads from: the subscripted value, or the object whose `get` is called."""
    if isinstance(node, ast.Subscript):
        return node.value
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    return node.func.value


def root_name(node: ast.AST) -> str | None:
    """The name a chain of reads starts from: `pv` in `(pv.get("spec") or {}).get("csi")`."""
    while True:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.BoolOp):
            node = node.values[0]
        elif isinstance(node, ast.Subscript | ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        else:
            return None


def _is_view(annotation: ast.AST | None) -> bool:
    return annotation is not None and bool(_VIEW_WORD.search(ast.unparse(annotation)))


def _is_conversion(value: ast.AST | None) -> bool:
    func = value.func if isinstance(value, ast.Call) else None
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name.endswith("_view") and hasattr(kinds, name)


def typed_names(func: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
    """The names bound to a typed view in this function: annotated parameters, and names
    assigned a conversion or annotated with a view."""
    args = func.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    names = {a.arg for a in params if _is_view(a.annotation)}
    for node in ast.walk(func):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and _is_view(node.annotation)
        ):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign | ast.NamedExpr) and _is_conversion(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


@dataclass(frozen=True)
class Read:
    file: str
    line: int
    key: str
    typed: bool
    get: bool  # x.get("k"), which mypy lets take any key even of a view (PEP 589)


def reads_in(path: Path, root: Path = REPO_ROOT, keys: frozenset[str] | None = KEYS) -> list[Read]:
    """The string-keyed reads in one file, of `keys` (None: of any key), and whether each is
    through a typed view."""
    tree = ast.parse(path.read_text(), str(path))
    rel = str(path.relative_to(root))
    scopes: dict[int, set[str]] = {}
    # The innermost function of each node decides what is typed there (a nested function sees
    # its enclosing function's names too).

    def visit(node: ast.AST, names: set[str]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            names = names | typed_names(node)
        scopes[id(node)] = names
        for child in ast.iter_child_nodes(node):
            visit(child, names)

    visit(tree, set())
    out = []
    for node in ast.walk(tree):
        key = string_key(node)
        if key is not None and (keys is None or key in keys):
            typed = root_name(receiver(node)) in scopes[id(node)]
            out.append(Read(rel, getattr(node, "lineno", 0), key, typed, isinstance(node, ast.Call)))
    return out


def runtime_reads(root: Path = REPO_ROOT, keys: frozenset[str] | None = KEYS) -> list[Read]:
    files = [path for package in runtime_packages(root) for path in sorted(package.rglob("*.py"))]
    return [r for path in files for r in reads_in(path, root, keys)]


def view_fields() -> frozenset[str]:
    """Every field some view declares."""
    return frozenset(key for name in VIEW_NAMES for key in getattr(kinds, name).__annotations__)


def main() -> int:
    reads = runtime_reads()
    per_package: Counter[str] = Counter()
    typed: Counter[str] = Counter()
    for r in reads:
        top = r.file.split("/")[0]
        per_package[top] += 1
        typed[top] += r.typed
    for top in sorted(per_package):
        print(f"{top:28} {per_package[top]:4} reads, {typed[top]:4} through a typed view")
    total, through = len(reads), sum(typed.values())
    print(f"{'total':28} {total:4} reads, {through:4} through a typed view, {total - through} untyped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
