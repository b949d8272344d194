"""The node agent's pod status writes through an apiserver that is briefly unreachable (found by
the chaos campaign: a pod whose Running status could not be written while the apiserver
restarted stayed Pending for good, its volume mounted): a failed write is tried again on the next
pass, for the Running status and for the final deletion alike; and a pass does not wait for them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

from controller_runtime.client import ApiClient
from controller_runtime.http_client import CannotConnect
from controller_runtime.informer import SharedInformer
from controller_runtime.resources import Obj
from services.node_agent.decide import PodVolume
from services.node_agent.pod_status import PodStatus
from services.node_agent.volume_manager import VolumeManager


class Unreachable:
    """Fails the first `down` calls as a refused connection, then records them."""

    def __init__(self, down: int) -> None:
        self.down = down
        self.calls: list[tuple[str, str]] = []

    def _call(self, verb: str, name: str) -> Obj:
        if self.down > 0:
            self.down -= 1
            raise CannotConnect("cannot connect to 127.0.0.1:6443")
        self.calls.append((verb, name))
        return {}

    async def patch(self, _res: Any, name: str, _patch: Obj, **_kw: Any) -> Obj:
        return self._call("patch", name)

    async def request(self, method: str, path: str, **_kw: Any) -> Obj:
        return self._call(method, path.rsplit("/", 1)[-1])


class Store:
    def __init__(self, pods: list[Obj]) -> None:
        self.pods = pods

    def values(self) -> list[Obj]:
        return self.pods


class Informer:
    def __init__(self, pods: list[Obj]) -> None:
        self.store = Store(pods)


class Volumes:
    def all_mounted(self, _vols: list[PodVolume]) -> bool:
        return True

    def pod_could_have_mounted_volumes(self, _uid: str) -> bool:
        return False


def pod(name: str, deleting: bool = False) -> Obj:
    md: Obj = {"name": name, "namespace": "ns", "uid": f"uid-{name}"}
    if deleting:
        md["deletionTimestamp"] = "2026-11-23T17:43:06Z"
    return {"metadata": md, "spec": {"containers": [{"name": "app"}]}, "status": {"phase": "Pending"}}


def status(client: Unreachable, pods: list[Obj], tmp_path: Path) -> PodStatus:
    return PodStatus(
        cast(ApiClient, client),
        cast(SharedInformer, Informer(pods)),
        tmp_path,
        cast(VolumeManager, Volumes()),
    )


async def test_running_is_written_again_after_the_apiserver_was_unreachable(tmp_path: Path) -> None:
    client = Unreachable(down=1)
    ps = status(client, [pod("app")], tmp_path)
    ps.sync({"ns/app": []})
    await ps.settled()
    assert client.calls == [], "the first write failed"
    ps.sync({"ns/app": []})
    await ps.settled()
    assert client.calls == [("patch", "app")], "the next pass writes Running again"
    ps.sync({"ns/app": []})
    await ps.settled()
    assert client.calls == [("patch", "app")], "once written, not again"


async def test_deletion_is_finished_again_after_the_apiserver_was_unreachable(tmp_path: Path) -> None:
    client = Unreachable(down=1)
    ps = status(client, [pod("gone", deleting=True)], tmp_path)
    ps.sync({})
    await ps.settled()
    assert client.calls == []
    ps.sync({})
    await ps.settled()
    assert client.calls == [("DELETE", "gone")]


class Held(Unreachable):
    """Every call waits until `release` is set (an apiserver slow to answer)."""

    def __init__(self) -> None:
        super().__init__(down=0)
        self.release = asyncio.Event()

    async def patch(self, _res: Any, name: str, _patch: Obj, **_kw: Any) -> Obj:
        await self.release.wait()
        return self._call("patch", name)


async def test_a_pass_does_not_wait_for_its_pod_writes(tmp_path: Path) -> None:
    """The volume pass that found pods ready goes on (an unstage, a volumesInUse write) while their
    status writes are under way, and does not start a second write for a pod meanwhile."""
    client = Held()
    ps = status(client, [pod("a"), pod("b")], tmp_path)
    ps.sync({"ns/a": [], "ns/b": []})
    ps.sync({"ns/a": [], "ns/b": []})
    await asyncio.sleep(0)
    assert client.calls == [], "sync returned with both writes still waiting"
    client.release.set()
    await ps.settled()
    assert sorted(client.calls) == [("patch", "a"), ("patch", "b")]


class Broken(Unreachable):
    """The first call fails in a way no handler foresees."""

    def _call(self, verb: str, name: str) -> Obj:
        if not self.calls and self.down > 0:
            self.down -= 1
            raise ValueError("unforeseen")
        return super()._call(verb, name)


async def test_an_unforeseen_failure_is_logged_and_the_write_started_again(tmp_path: Path) -> None:
    client = Broken(down=1)
    ps = status(client, [pod("app")], tmp_path)
    ps.sync({"ns/app": []})
    await ps.settled()
    assert client.calls == []
    ps.sync({"ns/app": []})
    await ps.settled()
    assert client.calls == [("patch", "app")]


async def test_marks_of_pods_gone_from_the_cache_are_dropped(tmp_path: Path) -> None:
    client = Unreachable(down=0)
    pods = [pod("app"), pod("gone", deleting=True)]
    ps = status(client, pods, tmp_path)
    ps.sync({"ns/app": []})
    await ps.settled()
    pods.clear()
    ps.sync({})
    assert not ps._reported_running and not ps._deleting
