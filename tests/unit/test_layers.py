"""The dependency rule between the repository's layers, checked on every .py file's imports.

- A process package (one per Kubernetes component or binary: every top-level package but
  `controller_runtime`, `kubeloop_grpc` and the tools on top, `localstack`, `tests`, `bench` and
  `driver_bench`;
  each subpackage of `services/`) imports only itself, `controller_runtime`, `kubeloop_grpc`, the
  standard library and third-party libraries: never another process package, `localstack`, `tests`
  or `bench`. The packages are found in the tree, so a new one is checked the day it appears.
- A composing package (`node_plugin`: several components in one process) imports only the `main`
  modules of process packages (a component's flags and its run), `controller_runtime` and
  `kubeloop_grpc`; no process package imports it.
- `controller_runtime` imports none of the process packages, `localstack`, `tests` or `bench`.
- `bench`, `driver_bench` and `localstack` never import `tests`.

Imports anywhere in a file count (inside functions and `if TYPE_CHECKING:` too). There is no list
of allowed exceptions: a violation is fixed where it is, not recorded here.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from controller_runtime.toolchain import REPO_ROOT

SHARED = "controller_runtime"
GENERATED = "kubeloop_grpc"
# The tools on top: they may import every layer below them (docs/architecture.md, "Layers").
ON_TOP = frozenset({"localstack", "tests", "bench", "driver_bench"})
# A folder of process packages rather than one: each of its subpackages is a process package.
CONTAINERS = frozenset({"services"})
# Packages that run several process packages' components in one process, through their `main`.
COMPOSERS = frozenset({"node_plugin"})
# What stands above the shared layer besides the process packages.
ABOVE_SHARED = CONTAINERS | ON_TOP | COMPOSERS
SKIPPED_DIRS = {".git", ".venv", ".kubeloop", GENERATED, "build", "dist", "__pycache__", "node_modules"}


def _packages(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir() and (p / "__init__.py").is_file())


def process_packages(root: Path) -> tuple[str, ...]:
    """Every top-level package but the shared layer, the generated stubs and the tools on top, and
    every subpackage of a container (services/): found in the tree, as import-boss inherits its
    rules by directory, so a package is checked the day it appears, with no list to update."""
    out: list[str] = []
    for top in _packages(root):
        if top in (SHARED, GENERATED) or top in ON_TOP or top in COMPOSERS:
            continue
        if top in CONTAINERS:
            out += [f"{top}.{sub}" for sub in _packages(root / top)]
        else:
            out.append(top)
    return tuple(out)


def first_party(root: Path) -> frozenset[str]:
    """Top-level names that are this repository's own code (the rest is stdlib or third-party)."""
    tops = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    return frozenset(tops | {GENERATED})


@dataclass(frozen=True)
class Layers:
    processes: tuple[str, ...]
    first_party: frozenset[str]

    def owner(self, module: str) -> str | None:
        """The layer a module belongs to: a process package, or a first-party top-level name;
        None for the standard library and third-party code."""
        for p in self.processes:
            if module == p or module.startswith(p + "."):
                return p
        top = module.split(".")[0]
        return top if top in self.first_party else None

    def forbidden(self, importer: str, target: str, module: str) -> str | None:
        """Why the layer `importer` may not import `module` of the layer `target`, or None when it
        may."""
        if target == importer:
            return None
        if importer in COMPOSERS:
            if target in (SHARED, GENERATED) or (target in self.processes and module == f"{target}.main"):
                return None
            return f"a composing package imports only process packages' main, {SHARED} and {GENERATED}"
        if importer in self.processes:
            if target in (SHARED, GENERATED):
                return None
            return f"a process package imports only itself, {SHARED} and {GENERATED}"
        if importer == SHARED and (target in self.processes or target in ABOVE_SHARED):
            return f"{SHARED} imports no process package, localstack, tests or bench"
        if importer in ("bench", "driver_bench", "localstack") and target == "tests":
            return "bench, driver_bench and localstack never import tests"
        return None


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    module: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: imports {self.module}: {self.reason}"


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, absolute module) for every import; `from m import a` yields m.a (a may be a
    submodule) so `from services import pv_controller` is seen for what it is."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".") if package else []
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                yield node.lineno, base if alias.name == "*" else f"{base}.{alias.name}"


def check_source(layers: Layers, rel: Path, source: str) -> list[Violation]:
    module = _module_name(rel)
    importer = layers.owner(module)
    if importer is None:
        return []
    tree = ast.parse(source, filename=str(rel))
    out = []
    seen = set()  # one violation per statement and layer, not one per imported name
    for line, target_module in imported_modules(tree, module, rel.name == "__init__.py"):
        target = layers.owner(target_module)
        if target is None or (line, target) in seen:
            continue
        seen.add((line, target))
        reason = layers.forbidden(importer, target, target_module)
        if reason is not None:
            out.append(Violation(str(rel), line, target_module, f"{importer} -> {target}: {reason}"))
    return out


def python_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.endswith(".egg-info"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath, name).relative_to(root)


def violations(root: Path) -> list[Violation]:
    layers = Layers(process_packages(root), first_party(root))
    out: list[Violation] = []
    for rel in python_files(root):
        out.extend(check_source(layers, rel, (root / rel).read_text()))
    return out


# -- the rule, on this repository ---------------------------------------------------------------


def test_imports_follow_the_layers() -> None:
    found = violations(REPO_ROOT)
    assert not found, "imports across layers (see docs/architecture.md):\n" + "\n".join(map(str, found))


def test_the_rule_sees_the_packages() -> None:
    layers = Layers(process_packages(REPO_ROOT), first_party(REPO_ROOT))
    assert {
        "csi_driver",
        "external_provisioner",
        "node_finalizer",
        "snapshot_metadata_setup",
        "kubectl_kubeloop",
        "services.pv_controller",
        "services.attach_detach",
        "services.volume_expand",
        "services.node_agent",
    } <= set(layers.processes)
    assert not {SHARED, GENERATED, "services", *ON_TOP} & set(layers.processes)
    assert {SHARED, "localstack", "tests", "bench"} <= layers.first_party


def test_a_new_package_is_checked_with_no_list_to_update(tmp_path: Path) -> None:
    files = {
        "controller_runtime/__init__.py": "",
        "controller_runtime/names.py": "",
        "csi_driver/__init__.py": "DRIVER_NAME = 'x'\n",
        "services/__init__.py": "",
        "services/pv_controller/__init__.py": "",
        "localstack/__init__.py": "from csi_driver import DRIVER_NAME\n",
        # Two packages nobody listed anywhere: a new top-level one and a new service.
        "brand_new/__init__.py": "",
        "brand_new/main.py": "from controller_runtime import names\nfrom csi_driver import DRIVER_NAME\n",
        "services/new_service/__init__.py": "",
        "services/new_service/loop.py": "from brand_new import main\nfrom ..pv_controller import x\n",
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert "brand_new" in process_packages(tmp_path)
    assert "services.new_service" in process_packages(tmp_path)
    assert [(v.file, v.line, v.module) for v in violations(tmp_path)] == [
        ("brand_new/main.py", 2, "csi_driver.DRIVER_NAME"),
        ("services/new_service/loop.py", 1, "brand_new.main"),
        ("services/new_service/loop.py", 2, "services.pv_controller.x"),
    ]


# -- the checker itself, on made-up files -------------------------------------------------------

LAYERS = Layers(
    ("csi_driver", "external_provisioner", "services.pv_controller", "services.node_agent"),
    frozenset({SHARED, GENERATED, "csi_driver", "external_provisioner"} | ABOVE_SHARED),
)


def check(path: str, source: str) -> list[str]:
    return [str(v) for v in check_source(LAYERS, Path(path), source)]


def test_process_packages_import_only_themselves_and_the_shared_layer() -> None:
    ok = """
import asyncio, grpc
from controller_runtime import storage
from controller_runtime.client import ApiClient
from kubeloop_grpc.csi import csi_pb2
from . import names
from .request import build_pv
from external_provisioner.journal import Journal
"""
    assert check("external_provisioner/controller.py", ok) == []
    bad = "import os\nfrom services.pv_controller.match import claim_class\n"
    assert check("external_provisioner/controller.py", bad) == [
        "external_provisioner/controller.py:2: imports services.pv_controller.match.claim_class: "
        "external_provisioner -> services.pv_controller: a process package imports only itself, "
        "controller_runtime and kubeloop_grpc"
    ]
    assert len(check("services/node_agent/agent.py", "from csi_driver.backend import mounts")) == 1
    assert len(check("services/node_agent/agent.py", "from services import pv_controller")) == 1
    assert len(check("services/node_agent/agent.py", "from ..pv_controller import names")) == 1
    assert check("services/node_agent/agent.py", "from .disk import Layout\nfrom . import plan") == []
    assert len(check("csi_driver/main.py", "def f():\n    import localstack.proc\n")) == 1
    assert len(check("csi_driver/main.py", "import tests.conftest")) == 1


def test_shared_layer_and_harnesses() -> None:
    assert len(check("controller_runtime/volumes.py", "from csi_driver import DRIVER_NAME")) == 1
    assert len(check("controller_runtime/volumes.py", "from localstack.proc import free_ports")) == 1
    assert check("controller_runtime/volumes.py", "from .storage import RWO\nimport grpc") == []
    assert len(check("localstack/components.py", "from tests.csi.conftest import Driver")) == 1
    assert len(check("bench/attach.py", "from tests.integration import support")) == 1
    # Harnesses on top may use everything below them.
    assert check("bench/attach.py", "from csi_driver import DRIVER_NAME\nfrom localstack import proc") == []
    assert (
        check("tests/unit/x.py", "from services.pv_controller import names\nfrom bench import common") == []
    )


def test_a_composing_package_imports_components_through_their_main_alone() -> None:
    """node_plugin runs the driver, provisioner and resizer in one process: their flags and run,
    nothing of their insides; and no component may lean on it."""
    ok = "from csi_driver import main as driver\nfrom external_provisioner import main\nimport grpc\n"
    assert check("node_plugin/main.py", ok + "from controller_runtime import process\n") == []
    assert check("node_plugin/main.py", "from csi_driver.backend import mounts") == [
        "node_plugin/main.py:1: imports csi_driver.backend.mounts: node_plugin -> csi_driver: a composing "
        "package imports only process packages' main, controller_runtime and kubeloop_grpc"
    ]
    assert len(check("node_plugin/main.py", "from localstack import proc")) == 1
    assert len(check("csi_driver/main.py", "from node_plugin.main import parse")) == 1
    assert len(check("controller_runtime/process.py", "import node_plugin")) == 1
