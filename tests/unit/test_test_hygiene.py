"""Tests that say what they wait for (issue 46): every module under tests/ is read, and the test
fails on

- an import of a `test_*` module: what tests share lives in a module named for what it holds
  (`tests/support/`, or beside its tests: `tests/csi/volumes.py`), never in another test module;
- a polling loop, a loop that sleeps until something holds: the one way to wait is
  `tests.support.waits` (`eventually`, and `consistently` for what must not happen);
- a sleep with an assert right after it (in the next two statements): a guessed time, then one
  look at the end. What must not happen is watched over the whole interval (`consistently`), or
  the test waits for observable progress (a pass count, an idle queue, a fake clock's waiter);
- a sleep in `tests/unit`, whose time is the fake clock's (`controller_runtime.clock_testing`).

`asyncio.sleep(0)`, a yield to the event loop, is no wait. Only tests/support holds the loops.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controller_runtime.toolchain import REPO_ROOT

TESTS = REPO_ROOT / "tests"
EXEMPT = ("support",)
AFTER_A_SLEEP = 2  # statements after a sleep in which an assert counts as its look


def modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.relative_to(TESTS).parts[0] not in EXEMPT)


def is_sleep(node: ast.AST) -> bool:
    """A call of time.sleep, asyncio.sleep or a bare sleep, for more than no time."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        named = (
            func.attr == "sleep" and isinstance(func.value, ast.Name) and func.value.id in ("time", "asyncio")
        )
    else:
        named = isinstance(func, ast.Name) and func.id == "sleep"
    first = node.args[0] if node.args else None
    return named and not (isinstance(first, ast.Constant) and first.value == 0)


def is_sleep_statement(stmt: ast.stmt) -> bool:
    value = stmt.value if isinstance(stmt, ast.Expr) else None
    return is_sleep(value.value if isinstance(value, ast.Await) else value) if value is not None else False


def below(nodes: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node under these statements, not entering nested functions or classes."""
    todo: list[ast.AST] = list(nodes)
    while todo:
        node = todo.pop()
        yield node
        todo += [
            c
            for c in ast.iter_child_nodes(node)
            if not isinstance(c, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda)
        ]


def ends_by_itself(loop: ast.For | ast.AsyncFor | ast.While) -> bool:
    """A loop that stops once something holds, as a wait does: a `while` on a condition, or a loop
    that breaks or returns. A `for` that nothing breaks does a fixed number of things (spaced by
    sleeps, as chaos's kills are), and a `while True` that nothing breaks is a background task (a
    ticker the test cancels): neither waits for anything."""
    forever = isinstance(loop, ast.While) and isinstance(loop.test, ast.Constant) and loop.test.value is True
    conditional = isinstance(loop, ast.While) and not forever
    return conditional or any(isinstance(n, ast.Break | ast.Return) for n in below(loop.body))


def imports_of_test_modules(source: str, package: tuple[str, ...]) -> list[int]:
    """The lines that import a `test_*` module of tests/ (`package`: the importing module's)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        if any(n.startswith("tests.") and n.rsplit(".", 1)[-1].startswith("test_") for n in names):
            assert isinstance(node, ast.Import | ast.ImportFrom)
            found.append(node.lineno)
    return found


def polling_loops(source: str) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.For | ast.AsyncFor | ast.While)
        and ends_by_itself(node)
        and any(is_sleep(n) for n in below([*node.body, *node.orelse]))
    ]


def sleeps_then_asserts(source: str) -> list[int]:
    found = []
    for node in ast.walk(ast.parse(source)):
        for block in ("body", "orelse", "finalbody"):
            stmts = getattr(node, block, None)
            if isinstance(stmts, list):
                for i, stmt in enumerate(stmts):
                    after = stmts[i + 1 : i + 1 + AFTER_A_SLEEP]
                    if is_sleep_statement(stmt) and any(isinstance(s, ast.Assert) for s in after):
                        found.append(stmt.lineno)
    return found


def sleeps(source: str) -> list[int]:
    return [
        node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call) and is_sleep(node)
    ]


def places(paths: list[Path], lines_of: Callable[[str], list[int]]) -> list[str]:
    return [f"{p.relative_to(REPO_ROOT)}:{n}" for p in paths for n in lines_of(p.read_text())]


def test_no_test_module_imports_another() -> None:
    found = [
        f"{path.relative_to(REPO_ROOT)}:{line}"
        for path in modules()
        for line in imports_of_test_modules(path.read_text(), path.relative_to(REPO_ROOT).parent.parts)
    ]
    assert not found, "test modules importing a test module (move what they share):\n" + "\n".join(found)


def test_no_polling_loop_outside_tests_support() -> None:
    found = places(modules(), polling_loops)
    assert not found, "loops that sleep until something holds (tests.support.waits):\n" + "\n".join(found)


def test_no_sleep_followed_by_an_assert() -> None:
    found = places(modules(), sleeps_then_asserts)
    assert not found, "a sleep, then an assert (consistently, or a wait on progress):\n" + "\n".join(found)


def test_unit_tests_never_sleep() -> None:
    found = places(sorted((TESTS / "unit").rglob("*.py")), sleeps)
    assert not found, "real sleeps in tests/unit (the fake clock of clock_testing):\n" + "\n".join(found)


# -- the checks catch what they say they catch -----------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "lines"),
    [
        ("from .test_driver import create", [1]),
        ("from tests.csi.test_driver import create", [1]),
        ("from . import test_external_resizer as resizer", [1]),
        ("import tests.unit.test_helm_chart", [1]),
        ("from .volumes import create\nfrom tests.support.waits import eventually", []),
        ("from .conftest import Driver", []),
    ],
)
def test_imports_of_test_modules_are_found(source: str, lines: list[int]) -> None:
    assert imports_of_test_modules(source, ("tests", "csi")) == lines


@pytest.mark.parametrize(
    ("source", "lines"),
    [
        ("while not done():\n    time.sleep(0.1)", [1]),
        ("for _ in range(50):\n    if ready():\n        break\n    await asyncio.sleep(0.1)", [1]),
        ("while True:\n    if ready():\n        return\n    time.sleep(1)", [1]),
        ("while True:\n    await asyncio.sleep(0.005)\n    clock.step(1)", []),  # a ticker
        ("for _ in range(3):\n    await asyncio.sleep(rng.uniform(0.5, 4))\n    kill()", []),  # spaced kills
        ("while not stop.is_set():\n    sample()\n    stop.wait(0.002)", []),
        ("while queue:\n    await asyncio.sleep(0)", []),
    ],
)
def test_polling_loops_are_found(source: str, lines: list[int]) -> None:
    assert polling_loops(f"async def f():\n{indented(source)}") == [n + 1 for n in lines]


@pytest.mark.parametrize(
    ("source", "lines"),
    [
        ("await asyncio.sleep(3)\nassert not expands", [1]),
        ("time.sleep(0.5)\nstatus = get()\nassert status is None", [1]),
        ("await asyncio.sleep(0.4)\nkill()\nawait asyncio.sleep(1)\nstart()", []),
        ("await asyncio.sleep(0)\nassert calls == []", []),
    ],
)
def test_sleeps_then_asserts_are_found(source: str, lines: list[int]) -> None:
    assert sleeps_then_asserts(f"async def f():\n{indented(source)}") == [n + 1 for n in lines]


def indented(source: str) -> str:
    return "".join(f"    {line}\n" for line in source.splitlines())


def test_sleeps_are_found_and_a_yield_is_not() -> None:
    source = "time.sleep(0.2)\nawait asyncio.sleep(0)\nawait asyncio.sleep(0.05)\nawait clock.sleep(5)"
    assert sleeps(f"async def f():\n{indented(source)}") == [2, 4]
    assert sleeps("x = 1") == []
