"""The attach-detach controller's two worlds on their own, in memory: ActualState (kcm's
ActualStateOfWorld: what the VolumeAttachment cache cannot say, merged with it on every pass) and
the node and Multi-Attach records of DesiredState (kcm's DesiredStateOfWorld)."""

from __future__ import annotations

from controller_runtime.volumes import unique_volume_name, va_name
from services.attach_detach.actual_state import STATUS_ECHO_SECONDS, ActualState, AttachOutcome
from services.attach_detach.decide import (
    ATTACH_TIMEOUT_ERROR,
    Attachment,
    DesiredEntry,
    DesiredVolume,
    PodRef,
)
from services.attach_detach.desired_state import DesiredState

DRIVER = "loop.csi.kubeloop.dev"
TIMEOUT = 120.0
P1 = PodRef("ns", "p1", "u1")
P2 = PodRef("ns", "p2", "u2")


def unique(handle: str) -> str:
    return unique_volume_name(DRIVER, handle)


def name(handle: str, node: str = "node-a") -> str:
    return va_name(handle, DRIVER, node)


def volume(handle: str = "v") -> DesiredVolume:
    return DesiredVolume(f"pv-{handle}", DRIVER, handle, unique(handle), multi_node=False)


def entry(handle: str = "v", node: str = "node-a", pods: tuple[PodRef, ...] = (P1,)) -> DesiredEntry:
    return DesiredEntry(node, volume(handle), pods)


def va(
    handle: str = "v",
    node: str = "node-a",
    *,
    attached: bool = False,
    deleting: bool = False,
    error: str = "",
) -> Attachment:
    """An attachment read from a VolumeAttachment (never pending)."""
    return Attachment(
        name(handle, node), node, f"pv-{handle}", DRIVER, handle, unique(handle), attached, deleting, error
    )


def listed(handle: str, node: str = "node-a") -> Attachment:
    """A volume a node's status.volumesAttached lists (no PV known)."""
    return Attachment(name(handle, node), node, "", DRIVER, handle, unique(handle), True, False)


def names(attachments: list[Attachment]) -> list[str]:
    return [a.name for a in attachments]


# -- the pass's attachments --------------------------------------------------------------------------


def test_listed_volumes_count_until_a_va_shows_or_the_periodic_check() -> None:
    actual = ActualState(TIMEOUT)
    actual.populate([listed("x"), listed("y"), listed("z")], vas={name("z")})
    assert actual.listed_without_attachment() == 2, "z has its VA: the VA is the truth"
    assert names(actual.get_attached_volumes([], 0.0)) == [name("x"), name("y")]

    # A VA for y supersedes the listing, and stays gone from it when the VA goes.
    assert names(actual.get_attached_volumes([va("y", attached=True)], 0.0)) == [name("y"), name("x")]
    assert names(actual.get_attached_volumes([], 0.0)) == [name("x")]

    # kcm's periodic check: a volume listed without a VA is not attached after all, unless its
    # detach runs.
    actual.remove_volume_from_report_as_attached(name("x"))
    actual.verify_volumes_are_attached()
    assert names(actual.get_attached_volumes([], 0.0)) == [name("x")]
    actual.add_volume_to_report_as_attached(name("x"))
    actual.verify_volumes_are_attached()
    assert actual.get_attached_volumes([], 0.0) == [] and actual.listed_without_attachment() == 0


def test_a_detached_listed_volume_leaves_the_actual_state() -> None:
    actual = ActualState(TIMEOUT)
    actual.populate([listed("x")], vas=set())
    actual.mark_volume_as_detached(name("x"))
    assert actual.get_attached_volumes([], 0.0) == []


def test_an_attach_is_pending_from_its_create_until_it_settles_or_times_out() -> None:
    actual = ActualState(TIMEOUT)
    actual.mark_attach_started(entry(), now=10.0)
    (creating,) = actual.get_attached_volumes([], 10.0)
    assert creating.pending and not creating.attached and creating.unique_name == unique("v")

    # The cache shows the VA: it replaces the create, pending while it waits for the attacher.
    (waiting,) = actual.get_attached_volumes([va()], 10.0 + TIMEOUT)
    assert waiting.pending
    (late,) = actual.get_attached_volumes([va()], 10.0 + TIMEOUT + 1)
    assert not late.pending, "timed out: uncertain"
    for settled in (va(attached=True), va(error="boom"), va(deleting=True)):
        (att,) = actual.get_attached_volumes([settled], 11.0)
        assert not att.pending, settled

    # The VA went away: the create is not brought back, and the attach is no longer waited for.
    assert actual.get_attached_volumes([], 11.0) == []
    actual.end_finished_operations([])
    (again,) = actual.get_attached_volumes([va()], 11.0)
    assert not again.pending


def test_a_failed_create_leaves_nothing_pending() -> None:
    actual = ActualState(TIMEOUT)
    actual.mark_attach_started(entry(), now=0.0)
    actual.mark_attach_failed(name("v"))
    assert actual.get_attached_volumes([], 0.0) == []


def test_an_attach_stops_being_waited_for_once_its_detach_starts() -> None:
    actual = ActualState(TIMEOUT)
    actual.mark_attach_started(entry(), now=0.0)
    actual.remove_volume_from_report_as_attached(name("v"))
    actual.end_finished_operations([va()])
    (att,) = actual.get_attached_volumes([va()], 1.0)
    assert not att.pending


# -- detach -------------------------------------------------------------------------------------------


def test_a_detach_runs_until_the_cache_shows_its_va_deleting_or_gone() -> None:
    actual = ActualState(TIMEOUT)
    actual.remove_volume_from_report_as_attached(name("v"))
    actual.remove_volume_from_report_as_attached(name("w"))
    actual.end_finished_operations([va("v"), va("w")])
    assert actual.detaching() == {name("v"), name("w")}
    actual.end_finished_operations([va("v", deleting=True)])
    assert actual.detaching() == frozenset()


def test_a_failed_detach_puts_the_volume_back_in_the_report() -> None:
    actual = ActualState(TIMEOUT)
    actual.remove_volume_from_report_as_attached(name("v"))
    actual.add_volume_to_report_as_attached(name("v"))
    assert actual.detaching() == frozenset()


def test_detach_request_time_is_kept_while_wanted_and_reset_after() -> None:
    actual = ActualState(TIMEOUT)
    actual.set_detach_requests({"a", "b"}, now=10.0)
    actual.set_detach_requests({"a", "b"}, now=20.0)
    assert actual.detach_request_times() == {"a": 10.0, "b": 10.0}
    actual.set_detach_requests({"a"}, now=30.0)
    actual.set_detach_requests({"a", "b"}, now=40.0)
    assert actual.detach_request_times() == {"a": 10.0, "b": 40.0}, "b was wanted again between"


# -- mounted by node ----------------------------------------------------------------------------------


def test_a_new_attachment_counts_as_mounted_until_the_node_reports() -> None:
    actual = ActualState(TIMEOUT)
    actual.populate([listed("old")], vas=set())
    actual.set_volumes_mounted_by_node("node-a", [])
    attachments = actual.get_attached_volumes([va("new", attached=True)], 0.0)
    actual.mark_new_volumes_mounted(attachments)
    assert actual.get_volumes_mounted_by_node("node-a") == {unique("new")}, "old was known at start"

    actual.set_volumes_mounted_by_node("node-a", [unique("old")])
    actual.mark_new_volumes_mounted(attachments)
    assert actual.get_volumes_mounted_by_node("node-a") == {unique("old")}, "new is no longer new"


def test_a_pending_attach_is_not_assumed_mounted_until_it_settles() -> None:
    actual = ActualState(TIMEOUT)
    actual.mark_attach_started(entry(), now=0.0)
    actual.mark_new_volumes_mounted(actual.get_attached_volumes([va()], 0.0))
    assert actual.get_volumes_mounted_by_node("node-a") == frozenset()
    actual.mark_new_volumes_mounted(actual.get_attached_volumes([va(attached=True)], 1.0))
    assert actual.get_volumes_mounted_by_node("node-a") == {unique("v")}


def test_a_deleted_node_keeps_its_last_report_while_anything_of_it_is_attached() -> None:
    actual = ActualState(TIMEOUT)
    actual.set_volumes_mounted_by_node("node-a", [unique("v")], deleted=True)
    actual.mark_new_volumes_mounted([va(attached=True)])
    assert actual.deleted_nodes() == {"node-a"}
    assert actual.get_volumes_mounted_by_node("node-a") == {unique("v")}
    actual.mark_new_volumes_mounted([])
    assert actual.deleted_nodes() == frozenset()
    assert actual.get_volumes_mounted_by_node("node-a") == frozenset()


def test_a_node_seen_again_is_no_longer_deleted() -> None:
    actual = ActualState(TIMEOUT)
    actual.set_volumes_mounted_by_node("node-a", [], deleted=True)
    actual.set_volumes_mounted_by_node("node-a", [unique("v")])
    assert actual.deleted_nodes() == frozenset()
    assert actual.get_volumes_mounted_by_node("node-a") == {unique("v")}


# -- attach outcomes ----------------------------------------------------------------------------------


def test_success_is_reported_once_to_the_pods_of_the_attach() -> None:
    actual = ActualState(TIMEOUT)
    actual.mark_attach_started(entry(pods=(P1,)), now=0.0)
    actual.mark_attach_created(name("v"))
    wanted = [entry(pods=(P1, P2))]  # p2 joined while the attach ran
    attaching = actual.get_attached_volumes([va()], 1.0)
    assert actual.take_attach_outcomes(wanted, attaching) == [], "still attaching"
    assert actual.take_attach_outcomes(wanted, [va(attached=True)]) == [AttachOutcome("pv-v", (P1,))]
    assert actual.take_attach_outcomes(wanted, [va(attached=True)]) == []


def test_each_distinct_error_is_reported_once_and_the_retry_reports_to_the_pods_of_then() -> None:
    actual = ActualState(TIMEOUT)
    actual.mark_attach_started(entry(pods=(P1,)), now=0.0)
    actual.mark_attach_created(name("v"))
    wanted = [entry(pods=(P1, P2))]
    assert actual.take_attach_outcomes(wanted, [va(error="boom")]) == [AttachOutcome("pv-v", (P1,), "boom")]
    assert actual.take_attach_outcomes(wanted, [va(error="boom")]) == []
    assert actual.take_attach_outcomes(wanted, [va(error="bang")]) == [
        AttachOutcome("pv-v", (P1, P2), "bang")
    ]
    assert actual.take_attach_outcomes(wanted, [va(attached=True)]) == [AttachOutcome("pv-v", (P1, P2))]


def test_an_attach_that_timed_out_reports_kcms_error() -> None:
    actual = ActualState(TIMEOUT)
    actual.mark_attach_started(entry(), now=0.0)
    actual.mark_attach_created(name("v"))
    late = actual.get_attached_volumes([va()], TIMEOUT + 1)
    error = ATTACH_TIMEOUT_ERROR.format(driver=DRIVER, handle="v")
    assert actual.take_attach_outcomes([entry()], late) == [AttachOutcome("pv-v", (P1,), error)]


def test_an_attachment_new_at_start_reports_its_success_to_the_pods_wanting_it_now() -> None:
    actual = ActualState(TIMEOUT)
    actual.populate([listed("w")], vas={name("v"), name("w")})
    attached = [va("v", attached=True), va("w", attached=True)]
    outcomes = actual.take_attach_outcomes([entry("v", pods=(P2,)), entry("w")], attached)
    assert outcomes == [AttachOutcome("pv-v", (P2,))], "w was listed: nothing to report"


def test_nothing_is_reported_for_a_volume_no_pod_wants() -> None:
    actual = ActualState(TIMEOUT)
    actual.mark_attach_created(name("v"))
    assert actual.take_attach_outcomes([], [va(attached=True)]) == []


def test_attach_records_of_gone_attachments_are_forgotten() -> None:
    actual = ActualState(TIMEOUT)
    actual.mark_attach_started(entry("v"), now=0.0)
    actual.mark_attach_started(entry("w"), now=0.0)
    for handle in ("v", "w"):
        actual.mark_attach_created(name(handle))
    actual.get_attached_volumes([va("v"), va("w")], 0.0)  # both in the cache: no longer creating
    actual.forget_attach_records({name("w")})
    attached = [va("v", attached=True), va("w", attached=True)]
    outcomes = actual.take_attach_outcomes([entry("v"), entry("w")], attached)
    assert outcomes == [AttachOutcome("pv-w", (P1,))], "v's VA was gone: a VA of its name is new"


def test_attach_records_are_kept_while_the_create_is_in_flight() -> None:
    actual = ActualState(TIMEOUT)
    actual.mark_attach_started(entry(pods=(P1,)), now=0.0)
    actual.mark_attach_created(name("v"))
    actual.forget_attach_records(set())
    outcomes = actual.take_attach_outcomes([entry(pods=(P1, P2))], [va(attached=True)])
    assert outcomes == [AttachOutcome("pv-v", (P1,))]


# -- node status --------------------------------------------------------------------------------------


def test_the_same_node_status_is_not_written_again_at_once() -> None:
    actual = ActualState(TIMEOUT)
    lst = (unique("v"),)
    assert actual.node_status_update_needed("node-a", lst, 0.0)
    actual.mark_node_status_updated("node-a", lst, 0.0)
    assert not actual.node_status_update_needed("node-a", lst, STATUS_ECHO_SECONDS - 0.1)
    assert actual.node_status_update_needed("node-a", (), 0.1), "another list"
    assert actual.node_status_update_needed("node-b", lst, 0.1), "another node"
    assert actual.node_status_update_needed("node-a", lst, STATUS_ECHO_SECONDS)


# -- desired state: nodes and Multi-Attach marks ------------------------------------------------------


def test_a_deleted_node_stays_managed_while_pods_want_volumes_on_it() -> None:
    desired = DesiredState()
    desired.add_node("node-a")
    desired.add_node("node-b")
    desired.set_pod(P1, "node-a", [volume()])
    desired.delete_node("node-a")
    desired.delete_node("node-b")
    assert desired.node_exists("node-a") and not desired.node_exists("node-b")
    desired.remove_pod(P1.key)
    desired.delete_node("node-a")
    assert not desired.node_exists("node-a")


def test_get_pods_lists_every_pod_that_wants_a_volume() -> None:
    desired = DesiredState()
    desired.set_pod(P1, "node-a", [volume()])
    desired.set_pod(P2, "node-a", [])
    assert desired.get_pods() == [P1]


def test_a_multi_attach_mark_lasts_while_the_volume_is_wanted_on_the_node() -> None:
    desired = DesiredState()
    desired.set_pod(P1, "node-b", [volume()])
    (wish,) = desired.entries()
    assert not desired.multi_attach_error_reported(wish)
    desired.set_multi_attach_error(wish)
    desired.set_pod(P2, "node-b", [volume()])  # another pod joins: still wanted there
    (joined,) = desired.entries()
    assert desired.multi_attach_error_reported(joined)

    desired.remove_pod(P1.key)
    desired.remove_pod(P2.key)
    assert desired.entries() == []
    desired.set_pod(P1, "node-b", [volume()])
    (again,) = desired.entries()
    assert not desired.multi_attach_error_reported(again), "wanted there anew: reported anew"
