"""The node agent's unmount on exit (issue 29, hole 8): on a requested stop, and only then, every
volume recorded on disk is unpublished, then unstaged, through the plugin, without the API; a
volume whose unpublish fails keeps its staging."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from controller_runtime.client import ApiClient
from controller_runtime.events import EventRecorder
from services.node_agent.agent import NodeAgent, Options
from services.node_agent.disk import VolData, write_vol_data
from services.node_agent.plugins import Plugin

DRIVER = "loop.csi.kubeloop.dev"


class _Node:
    """A CSI node service that records the calls (no mounts are made: the paths are plain dirs)."""

    def __init__(self, fail_unpublish: str = "") -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail_unpublish = fail_unpublish

    async def NodeUnpublishVolume(self, req: Any, **_kw: Any) -> None:
        self.calls.append(("unpublish", req.target_path))
        if req.volume_id == self.fail_unpublish:
            raise RuntimeError("rpc error: code = Internal desc = umount: target is busy")

    async def NodeUnstageVolume(self, req: Any, **_kw: Any) -> None:
        self.calls.append(("unstage", req.volume_id))


class _Conn:
    def __init__(self, node: _Node) -> None:
        self.node = node

    async def close(self) -> None:
        pass


def _agent(tmp_path: Path, node: _Node, unmount_on_exit: bool = True) -> NodeAgent:
    client = cast(ApiClient, object())  # any API call would fail: the unmount must make none
    recorder = cast(EventRecorder, object())
    a = NodeAgent(client, recorder, "node-a", tmp_path, Options(unmount_on_exit=unmount_on_exit))
    plugin = Plugin(DRIVER, cast(Any, _Conn(node)), "node-a", True, False, {}, 0)
    cast(dict[str, Plugin], a.volumes.plugins)[DRIVER] = plugin
    return a


def _stage(a: NodeAgent, handle: str) -> None:
    layout = a.volumes.layout
    data = VolData(f"pv-{handle}", handle, DRIVER, "node-a")
    write_vol_data(layout.staging_dir(DRIVER, handle) / "vol_data.json", data)
    layout.staging_path(DRIVER, handle).mkdir()


def _publish(a: NodeAgent, handle: str, uid: str) -> str:
    layout = a.volumes.layout
    target = layout.target_path(uid, f"pv-{handle}", False)
    data = VolData(f"pv-{handle}", handle, DRIVER, "node-a", podUID=uid)
    write_vol_data(target.parent / "vol_data.json", data)
    target.mkdir()
    return str(target)


def test_every_recorded_volume_is_unpublished_then_unstaged(tmp_path: Path) -> None:
    async def main() -> None:
        node = _Node()
        a = _agent(tmp_path, node)
        _stage(a, "v1")
        first, second = _publish(a, "v1", "uid-1"), _publish(a, "v1", "uid-2")
        _stage(a, "v2")  # staged, its publish undone already
        # Nothing restored into memory: the records on disk are what is undone.
        assert (await a.volumes.unmount_all()) == (2, 0)
        v1 = [c for c in node.calls if c[1] in (first, second, "v1")]
        assert v1 == [("unpublish", first), ("unpublish", second), ("unstage", "v1")]
        assert ("unstage", "v2") in node.calls
        assert a.volumes.layout.published() == {} and a.volumes.layout.staged() == {}
        assert not (tmp_path / "pods").exists() or not any((tmp_path / "pods").iterdir())

    asyncio.run(main())


def test_a_failed_unpublish_keeps_the_staging(tmp_path: Path) -> None:
    async def main() -> None:
        node = _Node(fail_unpublish="v1")
        a = _agent(tmp_path, node)
        _stage(a, "v1")
        _publish(a, "v1", "uid-1")
        _stage(a, "v2")
        _publish(a, "v2", "uid-2")
        assert (await a.volumes.unmount_all()) == (1, 1)
        assert ("unstage", "v1") not in node.calls, "never unstaged under a publish"
        assert set(a.volumes.layout.staged()) == {(DRIVER, "v1")}
        assert set(a.volumes.layout.published()) == {("uid-1", "pv-v1")}

    asyncio.run(main())


async def _run_until(a: NodeAgent, end: str) -> None:
    async def serve() -> None:
        if end == "crash":
            raise RuntimeError("the apiserver refused us")
        await asyncio.Event().wait()

    a._serve = serve  # type: ignore[method-assign]
    task = asyncio.create_task(a.run())
    await asyncio.sleep(0)
    if end == "stop":
        task.cancel()
    with pytest.raises((asyncio.CancelledError, RuntimeError)):
        await task


@pytest.mark.parametrize(
    ("end", "unmount_on_exit", "unmounted"),
    [("stop", True, True), ("crash", True, False), ("stop", False, False)],
)
def test_only_a_requested_stop_unmounts_and_only_when_asked(
    tmp_path: Path, end: str, unmount_on_exit: bool, unmounted: bool
) -> None:
    """A crash leaves the volumes mounted (the restarted agent takes them over, as kubelet), and so
    does a stop without --unmount-volumes-on-exit."""

    async def main() -> None:
        node = _Node()
        a = _agent(tmp_path, node, unmount_on_exit)
        _stage(a, "v1")
        _publish(a, "v1", "uid-1")
        await _run_until(a, end)
        assert bool(node.calls) == unmounted, node.calls
        assert bool(a.volumes.layout.staged()) != unmounted

    asyncio.run(main())
