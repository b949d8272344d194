"""Every `backticked` reference to this repository in docs/*.md and README.md names something that
exists: a module or a name in one (`csi_driver.state`, `controller_runtime.clock.Clock.sleep`), a
file or folder (`csi_driver/state.py`, `deploy/rbac/`, `tests/unit/test_*_decide.py`, a pytest
node id `tests/e2e/test_stack.py::test_rbac_is_enforced`).

Only a span whose first dotted or slashed part is a top-level package or folder of the repository
counts, so shell lines, Kubernetes field paths (`spec.claimRef`) and Go names are left alone, and
so are spans in fenced code blocks and placeholders (`<name>`, `{kind}`, `$HOME`). Names are found
by reading the modules' source (their top-level definitions and imports, a class's attributes), so
no module is imported to check a doc.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from controller_runtime.toolchain import REPO_ROOT

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
PATHLIKE = re.compile(r"[\w.*-]+(/[\w.*-]*)+(::\w+)?")
PLACEHOLDER = re.compile(r"[<>{}$]")
SKIPPED_TOPS = {"build", "dist", "node_modules", "__pycache__"}
# A Kubernetes object's parts: `spec.capacity` is a field path, not a module's name.
OBJECT_FIELDS = frozenset({"metadata", "spec", "status", "data"})
# A file's name (`images.sh`, `stack.log`) is not a module's.
FILE_SUFFIXES = frozenset(
    {"py", "sh", "log", "json", "yaml", "yml", "md", "toml", "txt", "proto", "env", "go", "sock"}
)


def docs(root: Path) -> list[Path]:
    return [*sorted((root / "docs").glob("*.md")), root / "README.md"]


def spans(text: str) -> list[tuple[int, str]]:
    """(line, text) of every inline code span outside fenced code blocks."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [(text.count("\n", 0, m.start()) + 1, m.group(1).strip()) for m in SPAN.finditer(text)]


@cache
def packages(root: Path) -> frozenset[str]:
    return frozenset(p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file())


@cache
def top_entries(root: Path) -> frozenset[str]:
    """The repository's own top-level files and folders (not hidden, not build output)."""
    return frozenset(
        p.name
        for p in root.iterdir()
        if not p.name.startswith(".") and p.name not in SKIPPED_TOPS and not p.name.endswith(".egg-info")
    )


@cache
def ignored_prefixes(root: Path) -> tuple[str, ...]:
    """The rooted folders of .gitignore (`/bench/results/`): what is in them is output, not code."""
    try:
        lines = (root / ".gitignore").read_text().splitlines()
    except OSError:
        return ()
    return tuple(line[1:] for line in lines if line.startswith("/") and line.endswith("/"))


@cache
def modules_by_stem(root: Path) -> dict[str, list[str]]:
    """Every module of the repository's packages by its last name (`decide` -> the decide.py's)."""
    out: dict[str, list[str]] = {}
    for top in packages(root):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out.setdefault(parts[-1], []).append(".".join(parts))
    return out


@cache
def defined_names(root: Path) -> frozenset[str]:
    """The functions and classes the repository's modules (but the tests') define at top level."""
    return frozenset(
        name
        for dotted in (m for ms in modules_by_stem(root).values() for m in ms)
        if not dotted.startswith("tests.") and (path := _module_file(root, dotted)) is not None
        for name, node in _bound_names(_parsed(path).body).items()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    )


def _elsewhere(name: str) -> bool:
    """A top-level module of the standard library or an installed library (not the repository)."""
    return name in sys.stdlib_module_names or importlib.util.find_spec(name) is not None


def reference(root: Path, span: str) -> str | None:
    """The span as a reference to check, or None when it names nothing of this repository."""
    if PLACEHOLDER.search(span) or " " in span:
        return None
    token = span.removesuffix("()").rstrip(".,:;")
    if DOTTED.fullmatch(token):
        first, *rest = token.split(".")
        if first in packages(root):
            return token
        # A name given by its module alone (`decide.plan_volumes`, in the text of its package):
        # checked when the repository defines the name somewhere.
        if (
            rest
            and rest[-1] not in FILE_SUFFIXES
            and rest[0] in defined_names(root)
            and first not in OBJECT_FIELDS
            and not _elsewhere(first)
        ):
            return token
    if (
        PATHLIKE.fullmatch(token)
        and token.split("/")[0] in top_entries(root)
        and not token.startswith(ignored_prefixes(root))
    ):
        return token
    return None


# -- resolving ------------------------------------------------------------------------------------


def _module_file(root: Path, dotted: str) -> Path | None:
    base = root.joinpath(*dotted.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py"), base.with_suffix(".pyi")):
        if candidate.is_file():
            return candidate
    return None


@cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _bound_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """What a module or class body binds: definitions, assignments and imports (also under if/try)."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out[name.id] = node
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                out[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.If | ast.Try):
            nested = node.body + node.orelse + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                nested = nested + handler.body
            out.update(_bound_names(nested))
    return out


def _class_names(cls: ast.ClassDef) -> dict[str, ast.AST]:
    """A class's attributes: its body, and dataclass-style fields and `self.x = ...` in its methods."""
    out = _bound_names(cls.body)
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            out.setdefault(node.attr, node)
    return out


def resolves_dotted(root: Path, token: str) -> bool:
    parts = token.split(".")
    # The longest prefix that is a module of the repository, then names inside it.
    for split in range(len(parts), 0, -1):
        module = _module_file(root, ".".join(parts[:split]))
        if module is not None:
            break
    else:
        return False
    names = _bound_names(_parsed(module).body)
    for i, attr in enumerate(parts[split:]):
        node = names.get(attr)
        if node is None:
            return False
        if i == len(parts[split:]) - 1:
            return True
        if isinstance(node, ast.ClassDef):
            names = _class_names(node)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            # A re-exported name: follow it where it comes from.
            return _resolves_import(root, module, node, attr, parts[split + i + 1 :])
        else:
            return False
    return True


def _resolves_import(
    root: Path, module: Path, node: ast.Import | ast.ImportFrom, name: str, rest: list[str]
) -> bool:
    if isinstance(node, ast.Import):
        return resolves_dotted(root, ".".join([name, *rest]))
    package = module.parent.relative_to(root).parts
    base: tuple[str, ...] = ()
    if node.level:
        base = package[: len(package) - (node.level - 1)]
    target = ".".join([*base, *([node.module] if node.module else [])])
    original = next(a.name for a in node.names if (a.asname or a.name) == name)
    return resolves_dotted(root, ".".join([target, original, *rest]))


def resolves_path(root: Path, token: str) -> bool:
    path, _, test = token.partition("::")
    if "*" in path:
        return bool(glob.glob(str(root / path)))
    target = root / path
    if not target.exists():
        return False
    if test:
        return test in _bound_names(_parsed(target).body)
    return True


def resolves(root: Path, token: str) -> bool:
    if "/" in token:
        return resolves_path(root, token)
    first, _, rest = token.partition(".")
    if first in packages(root):
        return resolves_dotted(root, token)
    return any(resolves_dotted(root, f"{m}.{rest}") for m in modules_by_stem(root).get(first, ()))


@dataclass(frozen=True)
class Stale:
    doc: str
    line: int
    reference: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: `{self.reference}`"


def stale_references(root: Path) -> list[Stale]:
    out = []
    for doc in docs(root):
        for line, span in spans(doc.read_text()):
            token = reference(root, span)
            if token is not None and not resolves(root, token):
                out.append(Stale(str(doc.relative_to(root)), line, token))
    return out


# -- the docs ---------------------------------------------------------------------------------------


def test_every_reference_in_the_docs_exists() -> None:
    stale = stale_references(REPO_ROOT)
    assert not stale, "references to nothing in the repository:\n" + "\n".join(map(str, stale))


def stale_docstring_references(root: Path) -> list[Stale]:
    """The same check on the docstrings of the repository's code (modules, classes, functions)."""
    out = []
    for top in sorted(packages(root) - {"tests", "kubeloop_grpc"}):
        for path in sorted((root / top).rglob("*.py")):
            for node in ast.walk(_parsed(path)):
                if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                doc = ast.get_docstring(node, clean=False)
                for line, span in spans(doc or ""):
                    token = reference(root, span)
                    if token is not None and not resolves(root, token):
                        first = node.body[0].lineno
                        out.append(Stale(str(path.relative_to(root)), first + line - 1, token))
    return out


def test_every_reference_in_the_docstrings_exists() -> None:
    stale = stale_docstring_references(REPO_ROOT)
    assert not stale, "docstrings name nothing in the repository:\n" + "\n".join(map(str, stale))


def test_the_docs_do_reference_the_code() -> None:
    # A guard against a checker that silently finds nothing to check.
    checked = [
        token
        for doc in docs(REPO_ROOT)
        for _, span in spans(doc.read_text())
        if (token := reference(REPO_ROOT, span)) is not None
    ]
    assert len(checked) > 100
    assert any("/" in t for t in checked) and any("." in t and "/" not in t for t in checked)


# -- the checker, on a made-up tree -----------------------------------------------------------------


def test_the_checker_finds_what_is_gone(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "deploy").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from .sub.mod import Thing as Thing\n")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "mod.py").write_text(
        "X = 1\nclass Thing:\n    y: int\n    def run(self):\n        self.z = 2\ndef test_it(): pass\n"
    )
    (tmp_path / "deploy" / "a.yaml").write_text("")
    (tmp_path / "README.md").write_text(
        "`pkg.sub.mod.X`, `pkg.sub.mod.Thing.run()`, `pkg.Thing.z`, `pkg/sub/mod.py::test_it`,\n"
        "`deploy/*.yaml`, `deploy/`, `spec.claimRef`, `kubectl get pv`, `pkg/<name>.py`\n"
        "```sh\npython -m pkg.gone\n```\n"
        "`pkg.sub.gone`, `pkg.sub.mod.Thing.missing`, `pkg.sub.mod.Y`, `deploy/b.yaml`,\n"
        "`pkg/sub/mod.py::test_gone`, `deploy/*.json`\n"
    )
    assert [(s.line, s.reference) for s in stale_references(tmp_path)] == [
        (6, "pkg.sub.gone"),
        (6, "pkg.sub.mod.Thing.missing"),
        (6, "pkg.sub.mod.Y"),
        (6, "deploy/b.yaml"),
        (7, "pkg/sub/mod.py::test_gone"),
        (7, "deploy/*.json"),
    ]
    (tmp_path / "pkg" / "other.py").write_text(
        'import os\n\n\ndef f():\n    """Uses `pkg.sub.mod.X`\n    and `pkg.sub.nothing`."""\n'
    )
    assert [(s.doc, s.line, s.reference) for s in stale_docstring_references(tmp_path)] == [
        ("pkg/other.py", 6, "pkg.sub.nothing")
    ]
