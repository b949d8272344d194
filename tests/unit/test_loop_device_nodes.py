"""The node a loop device needs inside a container, made in directories standing in for /dev and
/sys/block. mknod of a block device needs CAP_MKNOD, so the test records the call and leaves a
plain file where the node would be (tests/csi/test_loop_nodes.py makes a real one)."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import stat
import struct
from pathlib import Path

import pytest

from csi_driver.backend import loop
from csi_driver.backend.loop import DeviceNodes
from csi_driver.backend.tools import ToolError


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


def test_without_loop_control_there_is_no_free_device(nodes: DeviceNodes) -> None:
    with pytest.raises(FileNotFoundError):
        nodes.free_index()


@pytest.mark.parametrize(("failure", "attempts"), [(errno.EBUSY, 2), (errno.ENXIO, 1)])
async def test_attach_asks_for_another_device_only_when_the_first_was_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: int, attempts: int
) -> None:
    """Another user of the kernel configured the free device between LOOP_CTL_GET_FREE and
    LOOP_CONFIGURE (EBUSY): the attach asks for the next free one; any other failure stands."""
    backing = tmp_path / "v.img"
    backing.write_bytes(b"\0" * 4096)
    free = iter([5, 6])
    configured: list[tuple[int, bytes]] = []

    def free_index(self: DeviceNodes) -> int:
        return next(free)

    def open_device(self: DeviceNodes, name: str, flags: int = os.O_RDONLY, *, make: bool = True) -> int:
        return os.open(backing, os.O_RDONLY)  # any descriptor: the ioctl below is a stand-in

    def ioctl(fd: int, request: int, arg: bytes = b"") -> bytes:
        assert request == loop.LOOP_CONFIGURE
        configured.append((fd, arg))
        if len(configured) == 1:
            raise OSError(failure, os.strerror(failure))
        return arg

    monkeypatch.setattr(DeviceNodes, "free_index", free_index)
    monkeypatch.setattr(DeviceNodes, "open", open_device)
    monkeypatch.setattr(fcntl, "ioctl", ioctl)
    if attempts == 1:
        with pytest.raises(ToolError, match="No such device"):
            await loop.attach(str(backing), direct_io=False)
    else:
        assert (await loop.attach(str(backing), direct_io=False)).name == "/dev/loop6"
    assert len(configured) == attempts


def test_loop_configure_carries_the_backing_fd_and_flags() -> None:
    """struct loop_config as linux/loop.h lays it out: fd, block_size, then loop_info64 (304 bytes
    in all), with lo_flags 52 bytes and lo_file_name 56 bytes into loop_info64."""
    info = loop._INFO64.pack(0, 0, 0, 0, 0, 0, 0, 0, loop.LO_FLAGS_DIRECT_IO, b"/pool/v.img", b"", b"", 0, 0)
    config = loop._CONFIG.pack(9, 0, info, *([0] * 8))
    assert loop._INFO64.size == 232 and len(config) == 304
    assert struct.unpack_from("<2I", config, 0) == (9, 0)
    assert struct.unpack_from("<I", config, 8 + 52)[0] == loop.LO_FLAGS_DIRECT_IO
    assert config[8 + 56 : 8 + 56 + 11] == b"/pool/v.img"


def test_a_device_is_matched_to_its_backing_file_through_sysfs(nodes: DeviceNodes) -> None:
    (nodes.sys_block / "loop12" / "loop").mkdir()
    (nodes.sys_block / "loop12" / "loop" / "backing_file").write_text("/pool/volumes/a.img\n")
    assert asyncio.run(loop.is_attached("/dev/loop12", "/pool/volumes/a.img", nodes))
    # Another file, a device without a backing file, no device recorded: no.
    assert not asyncio.run(loop.is_attached("/dev/loop12", "/pool/volumes/b.img", nodes))
    assert not asyncio.run(loop.is_attached("/dev/loop300", "/pool/volumes/a.img", nodes))
    assert not asyncio.run(loop.is_attached("", "/pool/volumes/a.img", nodes))
