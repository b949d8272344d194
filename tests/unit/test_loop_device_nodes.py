"""The node a loop device needs inside a container, made in directories standing in for /dev and
/sys/block. mknod of a block device needs CAP_MKNOD, so the test records the call and leaves a
plain file where the node would be (tests/csi/test_loop_nodes.py makes a real one)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from csi_driver.backend import loop
from csi_driver.backend.loop import DeviceNodes
from csi_driver.backend.tools import Result, ToolError


@pytest.fixture
def nodes(tmp_path: Path) -> DeviceNodes:
    dev, sys_block = tmp_path / "dev", tmp_path / "sys" / "block"
    dev.mkdir()
    (sys_block / "loop12").mkdir(parents=True)
    # With loop.max_part=8 the kernel leaves room for partitions: loopN's minor is N << 3.
    (sys_block / "loop12" / "dev").write_text("7:96\n")
    (sys_block / "loop300").mkdir()
    (sys_block / "loop300" / "dev").write_text("7:2400\n")
    return DeviceNodes(dev=dev, sys_block=sys_block)


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int, int]]:
    calls: list[tuple[str, int, int, int]] = []

    def mknod(path: str | Path, mode: int, device: int) -> None:
        calls.append((str(path), stat.S_IFMT(mode), os.major(device), os.minor(device)))
        Path(path).touch(exist_ok=False)

    monkeypatch.setattr(os, "mknod", mknod)
    return calls


def test_a_missing_node_is_made_with_the_kernels_numbers(
    nodes: DeviceNodes, made: list[tuple[str, int, int, int]]
) -> None:
    assert nodes.ensure_node(12)
    assert nodes.ensure_node(300)
    assert made == [
        (str(nodes.dev / "loop12"), stat.S_IFBLK, 7, 96),
        (str(nodes.dev / "loop300"), stat.S_IFBLK, 7, 2400),
    ]
    assert stat.S_IMODE(os.stat(nodes.dev / "loop12").st_mode) == 0o660, "whatever the umask"


def test_an_existing_node_is_left_alone(nodes: DeviceNodes, made: list[tuple[str, int, int, int]]) -> None:
    (nodes.dev / "loop12").touch(mode=0o600)
    assert not nodes.ensure_node(12)
    assert made == []
    assert stat.S_IMODE(os.stat(nodes.dev / "loop12").st_mode) == 0o600


def test_a_device_the_kernel_does_not_have_is_an_error(
    nodes: DeviceNodes, made: list[tuple[str, int, int, int]]
) -> None:
    with pytest.raises(FileNotFoundError):
        nodes.ensure_node(13)
    assert made == [] and not (nodes.dev / "loop13").exists()


def test_without_loop_control_losetup_is_left_to_scan(
    nodes: DeviceNodes, made: list[tuple[str, int, int, int]]
) -> None:
    assert not nodes.ensure_free_node()
    assert made == []


@pytest.mark.parametrize(("made_after_failure", "attempts"), [(True, 2), (False, 1)])
async def test_attach_tries_again_only_when_the_failure_was_a_missing_node(
    monkeypatch: pytest.MonkeyPatch, made_after_failure: bool, attempts: int
) -> None:
    """Another user of the kernel took the device prepared for losetup, which then found the next
    one without a node: once that node is made, losetup runs again; any other failure stands."""
    prepared = [False, made_after_failure]
    runs: list[tuple[str, ...]] = []

    def ensure_free_node(self: DeviceNodes) -> bool:
        return prepared.pop(0)

    async def run(*argv: str) -> Result:
        runs.append(argv)
        if len(runs) == 1:
            raise ToolError(list(argv), 1, "losetup: /srv/v.img: failed to set up loop device")
        return Result(0, "/dev/loop5\n", "")

    monkeypatch.setattr(DeviceNodes, "ensure_free_node", ensure_free_node)
    monkeypatch.setattr(loop, "run", run)
    if attempts == 1:
        with pytest.raises(ToolError):
            await loop.attach("/srv/v.img")
    else:
        assert (await loop.attach("/srv/v.img")).name == "/dev/loop5"
    assert len(runs) == attempts and prepared == []
