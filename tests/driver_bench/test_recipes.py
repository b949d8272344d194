"""Recipes: kubeloop's own loads, and a bad one is a clear error naming the file, the field and
the problem, with nothing left running (the runner kills the whole process group)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from driver_bench import main as cli
from driver_bench.recipe import PLACEHOLDERS, RecipeError, load, parse
from tests.support.waits import eventually

from .recipes import KUBELOOP, buggy_recipe, write_recipe

REPO = Path(__file__).resolve().parents[2]


def test_kubeloop_recipe_loads() -> None:
    recipe = load(KUBELOOP)
    assert recipe.driver_name == "loop.csi.kubeloop.dev"
    assert recipe.node is not None and recipe.attach_required
    assert recipe.fs_type == "xfs" and recipe.inventory is not None
    assert recipe.volume.expand_to_bytes > recipe.volume.size_bytes


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"name": "x"}, ["controller", "missing"]),
        ({"controller": {}}, ["controller.command", "missing"]),
        ({"controller": {"command": []}}, ["controller.command", "non-empty list"]),
        (
            {"controller": {"command": ["d", "--x={nope}"]}},
            ["controller.command", "unknown placeholder {nope}"],
        ),
        ({"controller": {"command": ["d"]}, "ready": {"timeout_seconds": -1}}, ["ready.timeout_seconds"]),
        ({"controller": {"command": ["d"]}, "volume": {"size": "lots"}}, ["volume.size", "not a quantity"]),
        (
            {"controller": {"command": ["d"]}, "volume": {"size": "2Mi", "expand_to": "1Mi"}},
            ["volume.expand_to"],
        ),
        ({"controller": {"command": ["d"]}, "colour": "red"}, ["colour", "unknown field"]),
        ("just text", ["must be a YAML mapping"]),
    ],
)
def test_a_bad_recipe_names_its_field(doc: object, words: list[str]) -> None:
    with pytest.raises(RecipeError) as info:
        parse(doc, Path("/r.yaml"))
    assert all(w in str(info.value) for w in ["/r.yaml", *words]), str(info.value)


def test_every_placeholder_is_documented() -> None:
    doc = (REPO / "docs" / "driver-bench.md").read_text()
    assert all(f"{{{p}}}" in doc for p in PLACEHOLDERS)


def campaign_fails(tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    recipe = write_recipe(
        tmp_path / "bad.yaml", {"controller": {"command": command}, "ready": {"timeout_seconds": 3}}
    )
    rc = cli.main(["campaign", "--recipe", str(recipe), "--out", str(tmp_path / "out"), "--steps="])
    err = capsys.readouterr().err
    assert rc == 2, err
    return err


def gone(pid_file: Path) -> None:
    """Every process the command started is dead (kill -0 finds none)."""
    pids = [int(p) for p in pid_file.read_text().split()]
    assert pids

    def dead() -> list[int]:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        return alive

    eventually("the recipe's processes gone", lambda: not dead(), timeout=5, interval=0.05)


def test_a_driver_that_never_becomes_ready(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A shell that starts a child and then only sleeps: no socket ever appears.
    script = "sleep 600 & echo $! > {state_dir}/pids; echo $$ >> {state_dir}/pids; exec sleep 600"
    err = campaign_fails(tmp_path, ["sh", "-c", script], capsys)
    assert "never became ready within 3s" in err and "socket never appeared" in err, err
    gone(next((tmp_path / "out").rglob("pids")))


def test_a_command_that_exits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = campaign_fails(tmp_path, ["sh", "-c", "echo no such pool >&2; exit 3"], capsys)
    assert "exited with status 3 before it was ready" in err and "no such pool" in err, err


def test_a_command_that_cannot_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = campaign_fails(tmp_path, ["/nonexistent/driver", "--endpoint={endpoint}"], capsys)
    assert "controller.command: cannot run '/nonexistent/driver'" in err, err


def test_a_socket_that_is_not_csi(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A gRPC server with no service at all on the socket: it answers, UNIMPLEMENTED.
    server = (
        "import os, sys, grpc; from concurrent import futures; "
        "open(sys.argv[2], 'w').write(str(os.getpid())); "
        "s = grpc.server(futures.ThreadPoolExecutor(1)); s.add_insecure_port(sys.argv[1]); "
        "s.start(); s.wait_for_termination()"
    )
    err = campaign_fails(tmp_path, ["{python}", "-c", server, "{endpoint}", "{state_dir}/pids"], capsys)
    assert "answers, but not as a CSI driver" in err, err
    gone(next((tmp_path / "out").rglob("pids")))


def test_a_driver_of_another_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load(buggy_recipe(tmp_path, "").read_text())
    doc["driver_name"] = "other.csi.example.com"
    recipe = write_recipe(tmp_path / "other.yaml", doc)
    rc = cli.main(["campaign", "--recipe", str(recipe), "--out", str(tmp_path / "out"), "--steps="])
    err = capsys.readouterr().err
    assert rc == 2 and "reports the driver name 'buggy.csi.bench.kubeloop.dev'" in err, err
    assert "the recipe says 'other.csi.example.com'" in err, err
