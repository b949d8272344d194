"""The attach-detach controller's actual state of the world: which volumes are attached to which
nodes as far as the controller knows, whether each node has them mounted, and what the controller
itself has under way (kcm's ActualStateOfWorld, pkg/controller/volume/attachdetach/cache).

kcm keeps its actual state as a map of its own, changed when its operations end, and rebuilds it
from the nodes' status at a restart. kubeloop reads the VolumeAttachment cache afresh on every pass
instead (a VA is the truth, so a restart at any point starts from it), and this class keeps only
what the cache cannot say: creates the cache does not show yet, volumes a node listed at start
without a VA, the attaches and detaches this run has under way, when each detach was first
wanted, the "mounted by node" set of each node, which attach outcomes the pods were told, and the
node status lists last written. It decides nothing: `decide.decide` does, from what it returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from .decide import ATTACH_TIMEOUT_ERROR, Attachment, DesiredEntry, PodRef

# A node's status list written this recently is not written again: the cache can lag behind the
# write, and would show the old list for a pass or two.
STATUS_ECHO_SECONDS = 2.0


@dataclass(frozen=True)
class AttachOutcome:
    """The end of an attach, for the pods it reports to: success when error is ""."""

    pv_name: str
    pods: tuple[PodRef, ...]
    error: str = ""


@dataclass
class ActualState:
    # How long an attach may wait for status.attached before it counts as uncertain (kcm's CSI
    # attacher timeout).
    attach_timeout: float
    # Creates in flight (VA name -> pending Attachment): they count until the cache has the VA.
    _creating: dict[str, Attachment] = field(default_factory=dict, init=False)
    # Volumes a node's status.volumesAttached listed at start without a VolumeAttachment.
    _listed: dict[str, Attachment] = field(default_factory=dict, init=False)
    # VA name -> when this run started the attach it still waits for.
    _attach_started: dict[str, float] = field(default_factory=dict, init=False)
    # VA name -> the pods its attach reports to: those that wanted it when the attach started
    # (kcm's attach operation reports to the pods it was started for, not to later ones).
    _attach_pods: dict[str, tuple[PodRef, ...]] = field(default_factory=dict, init=False)
    # Attaches whose success is still to be reported (created here, or new to the actual state
    # at start, which kcm attaches again).
    _to_report: set[str] = field(default_factory=set, init=False)
    # VA name -> the attach error last reported for it (each distinct error is reported once).
    _errors_reported: dict[str, str] = field(default_factory=dict, init=False)
    # Detaches started whose VA the cache does not show as being deleted yet.
    _detaching: set[str] = field(default_factory=set, init=False)
    # VA name -> when its detach was first wanted (the max-wait-for-unmount timer).
    _detach_requested: dict[str, float] = field(default_factory=dict, init=False)
    # Node -> its "mounted by node" set of unique volume names; a deleted node keeps its last one.
    _mounted: dict[str, set[str]] = field(default_factory=dict, init=False)
    _deleted_nodes: set[str] = field(default_factory=set, init=False)
    # Names in the actual state at the last pass: a name new since then counts as mounted.
    _known: set[str] = field(default_factory=set, init=False)
    # Node -> (the volumesAttached list last written, when).
    _status_written: dict[str, tuple[tuple[str, ...], float]] = field(default_factory=dict, init=False)

    # -- start -------------------------------------------------------------------------------------

    def populate(self, listed: Iterable[Attachment], vas: Collection[str]) -> None:
        """kcm's populateActualStateOfWorld, at start: `listed` are the volumes the nodes'
        status.volumesAttached name, `vas` the names of the VolumeAttachments the cache holds.
        A listed volume counts as attached whether it has a VA or not (without one, until
        verify_volumes_are_attached); a VA that no node lists is new to the actual state, so it
        counts as mounted until its node reports again, and its attach is reported to the pods
        once it is attached (kcm attaches it again)."""
        names: set[str] = set()
        for att in listed:
            names.add(att.name)
            if att.name not in vas:
                self._listed[att.name] = att
        self._known = names
        self._to_report |= set(vas) - names

    def listed_without_attachment(self) -> int:
        """How many volumes count as attached only because a node listed them at start."""
        return len(self._listed)

    def verify_volumes_are_attached(self) -> None:
        """kcm's periodic check of its attached volumes (--attach-detach-reconcile-sync-period):
        a volume a node listed without a VolumeAttachment is not attached after all, unless its
        detach is under way (a wanted one is then attached anew)."""
        self._listed = {n: a for n, a in self._listed.items() if n in self._detaching}

    # -- each pass ---------------------------------------------------------------------------------

    def get_attached_volumes(self, vas: Iterable[Attachment], now: float) -> list[Attachment]:
        """Every (volume, node) attached, maybe attached or being attached (kcm's
        GetAttachedVolumes, which also holds the uncertain ones), given the VolumeAttachments the
        cache holds now (as Attachments, never pending): those VAs, then the creates the cache does
        not show yet, then the volumes listed at start without a VA. A VA supersedes the create
        and the listing of its name, which are forgotten. A VA whose attach this run started is
        pending until it is attached, reports an error, is deleted or `attach_timeout` passes."""
        out: dict[str, Attachment] = {}
        for att in vas:
            started = self._attach_started.get(att.name)
            # kcm's attach operation ends at success, a reported error, the VA's deletion or its
            # timeout; until then the VA is neither attached nor uncertain.
            if (
                started is not None
                and not (att.attached or att.deleting or att.attach_error)
                and now - started <= self.attach_timeout
            ):
                att = dataclasses.replace(att, pending=True)
            out[att.name] = att
            self._listed.pop(att.name, None)
        for name, att in list(self._creating.items()):
            if name in out:
                del self._creating[name]
            else:
                out[name] = att
        for name, att in self._listed.items():
            out.setdefault(name, att)
        return list(out.values())

    def mark_new_volumes_mounted(self, attachments: list[Attachment]) -> None:
        """kcm's AddVolumeNode marks a volume new to the actual state as mounted by its node
        ("assume mounted until proven otherwise"): the node's next report replaces the set. A
        pending attach is not in the actual state yet. A deleted node is forgotten once nothing
        of it is left in `attachments`."""
        members = {a.name for a in attachments if not a.pending}
        for att in attachments:
            if att.name in members and att.name not in self._known and att.unique_name:
                self._mounted.setdefault(att.node, set()).add(att.unique_name)
        self._known = members
        for node in self._deleted_nodes - {a.node for a in attachments}:
            self._deleted_nodes.discard(node)
            self._mounted.pop(node, None)

    def end_finished_operations(self, attachments: list[Attachment]) -> None:
        """A detach ends once the cache shows its VA being deleted or gone; an attach stops being
        waited for once its VA is gone or its detach started."""
        live = {a.name for a in attachments}
        self._detaching &= {a.name for a in attachments if not a.deleting}
        self._attach_started = {
            n: t for n, t in self._attach_started.items() if n in live and n not in self._detaching
        }

    def forget_attach_records(self, live: set[str]) -> None:
        """Drops what is kept for reporting attaches whose name is neither among `live` (the
        pass's attachments) nor being created."""
        kept = live | set(self._creating)
        self._to_report &= kept
        self._attach_pods = {n: p for n, p in self._attach_pods.items() if n in kept}

    # -- detach ------------------------------------------------------------------------------------

    def detach_request_times(self) -> Mapping[str, float]:
        """VA name -> when its detach was first wanted (kcm's DetachRequestedTime)."""
        return self._detach_requested

    def set_detach_requests(self, names: Collection[str], now: float) -> None:
        """kcm's SetDetachRequestTime for each of `names`, the attachments no pod wants now (a
        time already set is kept), and ResetDetachRequestTime for every other: a volume wanted
        again starts its wait for unmount from zero the next time."""
        self._detach_requested = {name: self._detach_requested.get(name, now) for name in names}

    def detaching(self) -> frozenset[str]:
        """The attachments whose detach this run started, until the cache shows their VA being
        deleted: neither detached again nor listed in their node's status."""
        return frozenset(self._detaching)

    def remove_volume_from_report_as_attached(self, name: str) -> None:
        """kcm's RemoveVolumeFromReportAsAttached, before a detach: the node's status stops
        listing the volume, and the detach counts as under way."""
        self._detaching.add(name)

    def add_volume_to_report_as_attached(self, name: str) -> None:
        """kcm's AddVolumeToReportAsAttached, after a failed detach: the volume is attached as
        before, listed in its node's status and detached again by a later pass."""
        self._detaching.discard(name)

    def mark_volume_as_detached(self, name: str) -> None:
        """kcm's MarkVolumeAsDetached, once the VA's deletion was accepted: a volume listed at
        start without a VA is gone from the actual state (one with a VA goes with the VA)."""
        self._listed.pop(name, None)

    # -- attach ------------------------------------------------------------------------------------

    def mark_attach_started(self, entry: DesiredEntry, now: float) -> None:
        """An attach of entry's volume to its node starts: its create counts as a pending
        attachment until the cache shows the VA, and the attach reports to entry's pods."""
        vol = entry.volume
        self._creating[entry.va_name] = Attachment(
            entry.va_name,
            entry.node,
            vol.pv_name,
            vol.driver,
            vol.handle,
            vol.unique_name,
            attached=False,
            deleting=False,
            pending=True,
        )
        self._attach_started[entry.va_name] = now
        self._attach_pods[entry.va_name] = entry.pods

    def mark_attach_created(self, name: str) -> None:
        """The VA of an attach was created: its success is to be reported once it is attached."""
        self._to_report.add(name)

    def mark_attach_failed(self, name: str) -> None:
        """The create of an attach failed: no VA exists, so nothing is being attached."""
        self._creating.pop(name, None)

    def take_attach_outcomes(
        self, desired: list[DesiredEntry], attachments: list[Attachment]
    ) -> list[AttachOutcome]:
        """The attach outcomes to report now, each once, for the entries still wanted: success
        for an attachment to report that became attached; an error for one that reports a new
        attachError or whose attach timed out waiting for the external-attacher (kcm's CSI
        attacher error). Success goes to the pods of the attach; an error too, and the attach
        retried after it reports to the pods that want it then, as kcm's next operation does.
        Without a record (an attachment found at start), the pods that want it now."""
        by_name = {a.name: a for a in attachments}
        out: list[AttachOutcome] = []
        for entry in desired:
            att = by_name.get(entry.va_name)
            if att is None:
                continue
            error = att.attach_error
            settled = error or att.attached or att.pending or att.deleting
            if not settled and att.name in self._attach_started:
                error = ATTACH_TIMEOUT_ERROR.format(driver=att.driver, handle=att.handle)
            pods = self._attach_pods.get(att.name, entry.pods)
            if att.attached and att.name in self._to_report:
                self._to_report.discard(att.name)
                self._errors_reported.pop(att.name, None)
                self._attach_pods.pop(att.name, None)
                out.append(AttachOutcome(entry.volume.pv_name, pods))
            elif error and self._errors_reported.get(att.name) != error:
                self._errors_reported[att.name] = error
                self._attach_pods[att.name] = entry.pods
                out.append(AttachOutcome(entry.volume.pv_name, pods, error))
        return out

    # -- mounted by node ---------------------------------------------------------------------------

    def set_volumes_mounted_by_node(self, node: str, names: Iterable[str], *, deleted: bool = False) -> None:
        """kcm's SetVolumesMountedByNode: the node's report (status.volumesInUse) replaces its
        "mounted by node" set, ending the assumed mounts of new attachments. `deleted` says the
        report is the node's last: its set is kept while anything of it stays attached."""
        self._mounted[node] = set(names)
        if deleted:
            self._deleted_nodes.add(node)
        else:
            self._deleted_nodes.discard(node)

    def get_volumes_mounted_by_node(self, node: str) -> frozenset[str]:
        """The unique volume names `node` has mounted, or is assumed to: while they are, a detach
        waits (kcm's MountedByNode)."""
        return frozenset(self._mounted.get(node, ()))

    def deleted_nodes(self) -> frozenset[str]:
        """Nodes deleted while something of theirs is still in the actual state."""
        return frozenset(self._deleted_nodes)

    # -- node status -------------------------------------------------------------------------------

    def node_status_update_needed(self, node: str, names: tuple[str, ...], now: float) -> bool:
        """Whether `names` should be written as the node's status.volumesAttached (kcm keeps a
        statusUpdateNeeded flag per node instead): not when this very list was written less than
        STATUS_ECHO_SECONDS ago."""
        last = self._status_written.get(node)
        return last is None or last[0] != names or now - last[1] >= STATUS_ECHO_SECONDS

    def mark_node_status_updated(self, node: str, names: tuple[str, ...], now: float) -> None:
        """The node's status.volumesAttached was written as `names` at `now`."""
        self._status_written[node] = (names, now)
