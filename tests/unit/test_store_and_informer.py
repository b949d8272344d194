"""The indexer and the informer's dispatch, fed directly (no API server)."""

from __future__ import annotations

from typing import Any, cast

from controller_runtime.client import ApiClient
from controller_runtime.informer import EventHandler, SharedInformer, SharedInformerFactory, compact
from controller_runtime.resources import (
    NODES,
    PERSISTENT_VOLUMES,
    PODS,
    Obj,
    key_of,
    object_key,
    reference_key,
    split_key,
)


def pv(name: str, phase: str = "Available", rv: str = "1", **extra: Any) -> Obj:
    return {"metadata": {"name": name, "resourceVersion": rv, **extra}, "status": {"phase": phase}}


def test_keys() -> None:
    assert key_of({"metadata": {"name": "a", "namespace": "ns"}}) == "ns/a"
    assert key_of({"metadata": {"name": "a"}}) == "a"
    assert split_key("ns/a") == ("ns", "a")
    assert split_key("a") == (None, "a")
    assert object_key("ns", "a") == "ns/a" and object_key(None, "a") == object_key("", "a") == "a"
    assert reference_key({"kind": "PersistentVolumeClaim", "namespace": "ns", "name": "a"}) == "ns/a"


def test_index_follows_updates_and_deletes() -> None:
    informer = SharedInformer(client=None, resource=PERSISTENT_VOLUMES)  # type: ignore[arg-type]
    store = informer.store
    store.add_index("phase", lambda o: [o["status"]["phase"]])
    store.upsert(pv("a"))
    store.upsert(pv("b"))
    assert {o["metadata"]["name"] for o in store.by_index("phase", "Available")} == {"a", "b"}
    store.upsert(pv("a", phase="Bound", rv="2"))
    assert [o["metadata"]["name"] for o in store.by_index("phase", "Available")] == ["b"]
    assert store.index_keys("phase", "Bound") == ["a"]
    store.delete("b")
    assert store.by_index("phase", "Available") == []
    assert "Available" not in store.index_values("phase"), "empty index buckets are dropped"


def test_index_added_late_indexes_existing_objects() -> None:
    informer = SharedInformer(client=None, resource=PERSISTENT_VOLUMES)  # type: ignore[arg-type]
    informer.store.upsert(pv("a"))
    informer.add_index("phase", lambda o: [o["status"]["phase"]])
    assert informer.store.index_keys("phase", "Available") == ["a"]


def test_replace_reports_changes_and_dispatches() -> None:
    informer = SharedInformer(client=None, resource=PERSISTENT_VOLUMES)  # type: ignore[arg-type]
    seen: list[tuple[str, str]] = []
    informer.add_handler(
        EventHandler(
            on_add=lambda o: seen.append(("add", o["metadata"]["name"])),
            on_update=lambda old, new: seen.append(("update", new["metadata"]["name"])),
            on_delete=lambda o: seen.append(("delete", o["metadata"]["name"])),
        )
    )
    informer.on_replace([pv("a"), pv("b")], "10")
    assert informer.has_synced
    assert sorted(seen) == [("add", "a"), ("add", "b")]
    seen.clear()
    informer.on_replace([pv("b", rv="11"), pv("c")], "12")  # a re-list after missing events
    assert sorted(seen) == [("add", "c"), ("delete", "a"), ("update", "b")]
    seen.clear()
    informer.on_event("MODIFIED", pv("c", rv="13"))
    informer.on_event("DELETED", pv("b", rv="14"))
    assert seen == [("update", "c"), ("delete", "b")]
    assert sorted(informer.store.keys()) == ["c"]


def test_late_handler_sees_existing_objects_and_a_failing_handler_is_contained() -> None:
    informer = SharedInformer(client=None, resource=PERSISTENT_VOLUMES)  # type: ignore[arg-type]

    def boom(obj: Obj) -> None:
        raise RuntimeError("handler bug")

    informer.add_handler(EventHandler(on_add=boom))
    informer.on_replace([pv("a")], "1")
    seen: list[str] = []
    informer.add_handler(EventHandler(on_add=lambda o: seen.append(o["metadata"]["name"])))
    assert seen == ["a"]


def test_factory_shares_an_informer_only_between_requests_for_the_same_selection() -> None:
    """client-go's factory with tweak-list-options: the same (resource, namespace, selectors) is
    one informer; other selectors, a cache of something else, are another."""
    factory = SharedInformerFactory(cast(ApiClient, None), resync_period=30.0)
    every_pod = factory.informer(PODS)
    on_node = factory.informer(PODS, field_selector="spec.nodeName=node-a")
    assert factory.informer(PODS) is every_pod
    assert factory.informer(PODS, field_selector="spec.nodeName=node-a") is on_node
    assert on_node is not every_pod
    assert factory.informer(PODS, field_selector="spec.nodeName=node-b") is not on_node
    labelled = factory.informer(PODS, label_selector="app=db")
    assert labelled not in (every_pod, on_node)
    assert factory.informer(PODS, "ns") is not every_pod
    assert factory.informer(NODES, field_selector="metadata.name=node-a") is not on_node
    assert on_node.reflector.selectors == {"labelSelector": "", "fieldSelector": "spec.nodeName=node-a"}
    assert labelled.reflector.selectors == {"labelSelector": "app=db", "fieldSelector": ""}
    assert on_node.resync_period == 30.0


def test_compact_drops_managed_fields_and_shares_repeated_strings() -> None:
    def fresh(name: str) -> Obj:
        # Built from pieces at run time so the strings start out as distinct objects.
        return pv(name, managedFields=[{"manager": "kubectl"}], labels={"tier": "".join(["fa", "st"])}) | {
            "spec": {"accessModes": ["".join(["Read", "WriteOnce"])]}
        }

    a, b = compact(fresh("a")), compact(fresh("b"))
    assert "managedFields" not in a["metadata"]
    assert a["metadata"]["labels"]["tier"] is b["metadata"]["labels"]["tier"]
    assert a["spec"]["accessModes"][0] is b["spec"]["accessModes"][0]
    assert a["metadata"]["name"] == "a" and b["metadata"]["name"] == "b"


async def test_resync_hands_out_current_copies_and_yields_between_batches() -> None:
    import asyncio

    informer = SharedInformer(client=None, resource=PERSISTENT_VOLUMES, resync_period=0.01)  # type: ignore[arg-type]
    informer.on_replace([pv(f"v{i:03d}") for i in range(450)], "1")
    seen: list[Obj] = []
    done = asyncio.Event()

    def on_update(old: Obj, new: Obj) -> None:
        if old is not new:
            return  # the watch event itself, not the resync
        seen.append(new)
        if len(seen) == 1:
            # An event arrives while the resync is under way: the resync must hand out this copy.
            asyncio.get_running_loop().call_soon(informer.on_event, "MODIFIED", pv("v449", rv="2"))
        if len(seen) == 450:
            done.set()

    informer.add_handler(EventHandler(on_update=on_update))
    task = asyncio.create_task(informer._resync_loop())
    try:
        await asyncio.wait_for(done.wait(), 5)
    finally:
        task.cancel()
    first_round = seen[:451]
    last = [o for o in first_round if o["metadata"]["name"] == "v449"]
    assert last[-1]["metadata"]["resourceVersion"] == "2", "the resync yielded and sent the new copy"
