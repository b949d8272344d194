"""kubeloop-node-plugin's command line (sections per component, each parsed by the component's own
parser; what belongs to the process refused in a section) and process.serve_together, which runs
the components: the process ends with the first of them to fail, and cancels the rest."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from controller_runtime import process
from csi_driver import main as driver
from external_provisioner import main as provisioner
from external_resizer import main as resizer
from node_plugin.main import parse, split

DRIVER = ["--", "csi-driver", "--mode=all", "--node-local", "--node-id=n1"]


def test_sections_are_split_at_each_separator() -> None:
    own, sections = split(["--v=4", "--", "csi-driver", "--mode=all", "--", "external-resizer"])
    assert own == ["--v=4"]
    assert sections == [("csi-driver", ["--mode=all"]), ("external-resizer", [])]


def test_each_section_is_parsed_by_its_components_own_parser() -> None:
    args, parts = parse(
        [
            "--http-endpoint=:8080",
            *DRIVER,
            "--",
            "external-provisioner",
            "--node-deployment",
            "--csi-address=/csi/csi.sock",
            "--",
            "external-resizer",
            "-node-deployment=true",  # Go's flag syntax, as upstream's csi-resizer takes it
        ]
    )
    assert args.http_endpoint == ":8080"
    (run_d, args_d), (run_p, args_p), (run_r, args_r) = parts
    assert (run_d, run_p, run_r) == (driver.run, provisioner.run, resizer.run)
    assert args_d.mode == "all" and args_d.node_local and args_d.node_id == "n1"
    assert args_p.node_deployment and args_p.csi_address == "/csi/csi.sock"
    assert args_r.node_deployment


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--", "external-resizer"], "`-- csi-driver FLAGS` is required"),
        ([*DRIVER, "--", "csi-driver"], "each component may be given once"),
        ([*DRIVER, "--", "external-snapshotter"], "unknown component 'external-snapshotter'"),
        ([*DRIVER, "--"], "`--` must be followed by a component"),
        (
            [*DRIVER, "--", "external-resizer", "-http-endpoint=:8083"],
            "-http-endpoint=:8083 is the process's",
        ),
        (
            [*DRIVER, "--", "external-provisioner", "--v", "5"],
            "--v is the process's, not external-provisioner's",
        ),
        (["--", "csi-driver", "--log-format=json"], "--log-format=json is the process's"),
    ],
)
def test_what_cannot_work_is_refused_naming_it(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as refused:
        parse(argv)
    assert message in str(refused.value)


def test_a_components_help_is_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        parse(["--", "external-provisioner", "--help"])
    assert done.value.code == 0
    assert "kubeloop-external-provisioner" in capsys.readouterr().out


async def test_serve_together_ends_with_the_first_failure_and_cancels_the_rest() -> None:
    cancelled: list[str] = []
    started = asyncio.Event()

    async def waits(_args: argparse.Namespace, ctx: process.Context) -> None:
        assert ctx.health is None  # no endpoint asked for
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append("waits")
            raise

    async def fails(_args: argparse.Namespace, _ctx: process.Context) -> None:
        await started.wait()
        raise RuntimeError("the resizer cannot reach the apiserver")

    none = argparse.Namespace()
    assert await process.serve_together([(waits, none), (fails, none)], "") == 1
    assert cancelled == ["waits"]

    async def returns(_args: argparse.Namespace, _ctx: process.Context) -> None:
        return None

    assert await process.serve_together([(returns, none), (returns, none)], "") == 0
