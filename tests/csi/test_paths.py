"""csi_driver.paths: request paths confined to the kubelet directory, walked without following
any symlink. Plain files in a temporary directory; no root needed."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from csi_driver.errors import CsiError
from csi_driver.paths import KubeletDir


@pytest.fixture
def layout(tmp_path: Path) -> tuple[KubeletDir, Path, Path]:
    kubelet, outside = tmp_path / "kubelet", tmp_path / "outside"
    (kubelet / "pods").mkdir(parents=True)
    (outside / "etc").mkdir(parents=True)
    (outside / "etc" / "passwd").write_text("root")
    os.symlink(outside / "etc", kubelet / "etc")
    os.symlink(outside / "etc" / "passwd", kubelet / "passwd")
    os.symlink("..", kubelet / "pods" / "parent")
    return KubeletDir(kubelet), kubelet, outside


def refused(fn: Callable[..., object], *args: object) -> bool:
    try:
        fn(*args)
    except CsiError as e:
        return bool(e.code == grpc.StatusCode.INVALID_ARGUMENT)
    return False


def test_the_root_is_resolved_once(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert KubeletDir(tmp_path / "link").root == str(tmp_path / "real")
    with pytest.raises(ValueError):
        KubeletDir(tmp_path / "missing")


@pytest.mark.parametrize(
    "rel",
    ["", "/", "/..", "/../outside", "/./pods", "/pods/../etc", "/a\x00b", "x" * 300, "/" + "d/" * 2100],
)
def test_lexically_bad_paths_are_refused(layout: tuple[KubeletDir, Path, Path], rel: str) -> None:
    k, kubelet, _ = layout
    assert refused(k.check, str(kubelet) + rel, "target_path")


def test_paths_outside_are_refused(layout: tuple[KubeletDir, Path, Path]) -> None:
    k, kubelet, outside = layout
    for path in [str(outside), "/etc/passwd", "relative", str(kubelet) + "x/y", str(kubelet)]:
        assert refused(k.check, path, "target_path"), path
    assert k.check(str(kubelet) + "//pods/", "target_path") == str(kubelet / "pods")


def test_symlinks_are_never_followed(layout: tuple[KubeletDir, Path, Path]) -> None:
    k, kubelet, outside = layout
    before = sorted(os.listdir(outside / "etc"))
    for path in ["etc", "etc/new", "passwd", "pods/parent/etc", "pods/parent/pods/x"]:
        full = str(kubelet / path)
        assert refused(k.validate, full, "target_path"), path
        assert refused(k.make_dir, full, "target_path"), path
        assert refused(k.make_file, full, "target_path"), path
        if "/" in path:
            assert refused(k.remove, full, "target_path"), path
    assert sorted(os.listdir(outside / "etc")) == before
    assert (outside / "etc" / "passwd").read_text() == "root"


def test_make_and_remove_report_what_they_created(layout: tuple[KubeletDir, Path, Path]) -> None:
    k, kubelet, _ = layout
    target = str(kubelet / "pods" / "a" / "b" / "target")
    assert k.make_dir(target, "t") is True
    assert k.make_dir(target, "t") is False
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o750
    dev = str(kubelet / "pods" / "a" / "dev")
    assert k.make_file(dev, "t") is True and k.make_file(dev, "t") is False
    assert stat.S_IMODE(os.stat(dev).st_mode) == 0o600
    assert refused(k.make_file, target, "t")  # a directory is not a file target
    assert refused(k.make_dir, dev, "t")
    k.remove(dev, "t")
    k.remove(target, "t")
    k.remove(target, "t")  # idempotent
    assert not os.path.exists(dev) and not os.path.exists(target)
    assert k.exists(str(kubelet / "pods"), "t") and not k.exists(str(kubelet / "passwd"), "t")
