"""A container's /dev, played by a directory holding only loop-control: the driver gives the loop
device it is about to configure a real node there, with the kernel's numbers."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from csi_driver.backend.loop import DeviceNodes

pytestmark = pytest.mark.root


def test_the_next_free_loop_device_gets_a_node(csi_root: Path) -> None:
    dev = csi_root / "container-dev"
    dev.mkdir()
    os.symlink("/dev/loop-control", dev / "loop-control")
    nodes = DeviceNodes(dev=dev)
    index = nodes.free_index()
    (made,) = [p for p in dev.iterdir() if p.name.startswith("loop") and p.name != "loop-control"]
    assert made.name == f"loop{index}"
    st = os.lstat(made)
    assert stat.S_ISBLK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    kernel = (Path("/sys/block") / made.name / "dev").read_text().strip()
    assert f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" == kernel
    # (Whether it is still the free one is not asked: other loop users share the kernel.)
