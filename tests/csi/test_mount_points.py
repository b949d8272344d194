"""controller_runtime.mounts.is_mounted asks the kernel (statx's mount-root attribute) instead of
reading the whole mount table; it must answer as the table does for every kind of path the node
plugin and the node agent ask about, but for a mount hidden by another made over its parent.
Real tmpfs and bind mounts in a temporary directory, as root."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller_runtime import mounts

from .conftest import require_root


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@pytest.fixture
def base(tmp_path: Path) -> Iterator[Path]:
    require_root()
    root = tmp_path / "mnt"
    root.mkdir()
    run("mount", "-t", "tmpfs", "-o", "size=1m", "kubeloop-test", str(root))
    try:
        yield root
    finally:
        run("umount", "--lazy", str(root))  # detaches everything under it, hidden mounts included


def both(path: Path) -> bool:
    """The kernel's answer, after checking it against the table's."""
    fast = mounts.is_mounted(str(path))
    assert fast == mounts.is_mounted(str(path), mounts.read_mounts()), path
    return fast


def test_the_kernel_answers_as_the_table_does(base: Path) -> None:
    (base / "plain").mkdir()
    (base / "bound").mkdir()
    (base / "file").write_text("")
    (base / "device").write_text("")
    run("mount", "--bind", str(base / "plain"), str(base / "bound"))  # same filesystem: st_dev cannot tell
    run("mount", "--bind", str(base / "file"), str(base / "device"))  # a file, as a block volume's target
    (base / "link").symlink_to(base / "bound")
    (base / "linked-parent").symlink_to(base)

    assert mounts._mount_root(str(base)) is True, "statx with the mount-root attribute is used here"
    assert both(base)
    assert both(base / "bound")
    assert both(base / "device")
    assert both(Path(str(base) + "/plain/../bound"))  # normalised first, as the table's lookup does
    assert not both(base / "plain")
    assert not both(base / "file")
    assert not both(base / "missing")
    assert not both(base / "missing" / "deeper")
    assert not both(base / "file" / "under-a-file")
    assert not both(base / "link"), "a symlink to a mount point is not one"
    assert mounts._mount_root(str(base / "linked-parent" / "bound")) is None, "left to the table"
    assert not both(base / "linked-parent" / "bound")
    assert mounts._mount_root("relative/path") is None
    assert mounts._mount_root(str(base) + "\0/plain") is None, "a NUL would cut the path short"


def test_a_mount_hidden_under_another_is_not_a_mount_point_for_the_kernel(base: Path) -> None:
    parent = base / "parent"
    (parent / "child").mkdir(parents=True)
    run("mount", "-t", "tmpfs", "-o", "size=1m", "hidden", str(parent / "child"))
    run("mount", "-t", "tmpfs", "-o", "size=1m", "over", str(parent))
    (parent / "child").mkdir()
    # The path now leads into the mount made over its parent, as kubelet's own check sees it; the
    # table still lists the hidden mount.
    assert not mounts.is_mounted(str(parent / "child"))
    assert mounts.is_mounted(str(parent / "child"), mounts.read_mounts())


def test_stacked_mounts_unmount_one_at_a_time(base: Path) -> None:
    target = base / "target"
    target.mkdir()
    run("mount", "-t", "tmpfs", "-o", "size=1m", "lower", str(target))
    run("mount", "-t", "tmpfs", "-o", "size=1m", "upper", str(target))
    assert both(target)
    run("umount", str(target))
    assert both(target), "the lower mount is still there"
    run("umount", str(target))
    assert not both(target)
