"""The provisioner's intent journal: which CreateVolume calls may have created a volume that no
PersistentVolume records yet.

Upstream's sidecar keeps this only in memory, so a restart between CreateVolume and saving the PV
forgets the volume and, if the claim is deleted meanwhile, leaks it. kubeloop journals an entry
durably *before* CreateVolume and removes it only once the PV is saved or the volume is known not
to exist; at start every entry is finished or cleaned up. The journal lives on local disk next to
the driver's own state (the pool is local to the machine too), so it costs no API request on the
provisioning path.

The journal is one append-only log, `journal.log`: a JSON line per change, `{"put": entry}` or
`{"remove": uid}`, read in order at start. An entry is durable once the log is fsync'd after its
line. Writes that arrive together are committed together (group commit): each caller's line joins
a batch that one thread appends with one write and, when any of them must be durable, one fsync;
each caller returns once its batch is done. A file per entry (the journal's earlier form) cost a
file fsync, a rename and a directory fsync per claim and, on the development VM's ext4, 0.5-1 ms
of system CPU to create each file; a log line costs a share of one write and one fsync (issue 49,
docs/benchmarks.md). A removal (or an unsynced update) that finds no batch pending is appended at
once on the caller's thread: under the client's QPS limit claims finish one at a time, and a
thread hop there cost more than the write it carried.

What a crash can leave, and how a load reads it: every line up to the last fsync is on disk; lines
after it may be missing, cut, or (after a power loss) garbage. No entry acknowledged as durable lies
after them, because its fsync made everything before it durable too. So a load reads lines up to
the first one that is not a whole JSON record and drops the rest: what it drops was either never
acknowledged (a put whose CreateVolume was never sent) or harmless to lose (a removal or an unsynced
update: the entry is re-checked). A load then writes the live entries to a fresh log (fsync'd,
renamed into place): the torn tail is gone before anything is appended after it. The same rewrite,
on the committing thread, keeps the log short (COMPACT_AT).
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from controller_runtime.files import FileLock, fsync_dir, is_temp_name, write_all, write_atomic
from controller_runtime.logs import get_logger

from .request import VolumeSpec

log = get_logger("external-provisioner")

LOG_NAME = "journal.log"
# The log is rewritten with only its live entries once it is past this size and at least half of
# it is dead lines: a burst of 1,000 claims appends about 0.7 MiB, so a busy provisioner rewrites a
# few dozen entries every thousand or so claims, and an idle one keeps at most this much.
COMPACT_AT = 1 << 20


@dataclass
class Entry:
    uid: str  # the claim's UID; also the file name
    namespace: str
    claim: str
    class_name: str
    spec: VolumeSpec
    volume_id: str = ""  # known once CreateVolume answered; saves a CreateVolume during clean-up

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "namespace": self.namespace,
            "claim": self.claim,
            "class_name": self.class_name,
            "spec": self.spec.to_json(),
            "volume_id": self.volume_id,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Entry:
        return cls(
            uid=doc["uid"],
            namespace=doc["namespace"],
            claim=doc["claim"],
            class_name=doc.get("class_name", ""),
            spec=VolumeSpec.from_json(doc["spec"]),
            volume_id=doc.get("volume_id", ""),
        )


def read(directory: Path) -> dict[str, Entry]:
    """The entries journalled in `directory`, by claim UID, read without changing anything there
    (what a load starts from; tests and tools read a journal this way too)."""
    entries: dict[str, Entry] = {}
    # The journal's earlier form, a file per entry, read first: a provisioner upgraded with entries
    # in flight finishes them, and its first load folds them into the log.
    for path in sorted(directory.glob("*.json")):
        entry = Entry.from_json(orjson.loads(path.read_bytes()))
        entries[entry.uid] = entry
    try:
        data = (directory / LOG_NAME).read_bytes()
    except FileNotFoundError:
        return entries
    records, end = _records(data)
    for record in records:
        if "put" in record:
            entry = Entry.from_json(record["put"])
            entries[entry.uid] = entry
        else:
            entries.pop(record["remove"], None)
    if end < len(data):
        dropped = len(data) - end
        log.warning("dropped the journal's unsynced tail", path=str(directory / LOG_NAME), bytes=dropped)
    return entries


def _records(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """A log's whole records, up to the first line that is cut or is not a record (the module
    docstring says why nothing after it counts), and the offset where they end."""
    records: list[dict[str, Any]] = []
    start = 0
    while (newline := data.find(b"\n", start)) >= 0:
        try:
            record = orjson.loads(data[start:newline])
        except orjson.JSONDecodeError:
            break
        if not isinstance(record, dict) or not (
            isinstance(record.get("put"), dict) or isinstance(record.get("remove"), str)
        ):
            break
        records.append(record)
        start = newline + 1
    return records, start


def _put_line(entry: Entry) -> bytes:
    # orjson writes the dataclasses as to_json() has them (every field, in order, nested ones as
    # objects), in a tenth of the time of asdict and json.dumps.
    return orjson.dumps({"put": entry}, option=orjson.OPT_APPEND_NEWLINE)


@dataclass
class _Change:
    """One line to append, and the caller waiting for it."""

    uid: str
    line: bytes
    is_put: bool
    durable: bool
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Journal:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.entries: dict[str, Entry] = {}
        # One provisioner writes a journal: a second one on the same directory (a restart whose
        # predecessor still exits) waits for it rather than append beside it.
        self.lock = FileLock(directory / ".lock")
        self._changes: list[_Change] = []
        self._committing: asyncio.Task[None] | None = None
        # Only _append and _write_fresh touch these, under _io: on the loop's thread when no batch
        # is pending, else on the one thread that carries the batches out; close() waits for it.
        self._io = threading.Lock()
        self._closed = False
        self._fd: int | None = None  # the log, opened for appending
        self._size = 0  # its length
        self._live: dict[str, bytes] = {}  # each entry's line as last appended: what a rewrite keeps
        self._live_size = 0
        self._earlier: list[Path] = []  # files of the journal's earlier form, until the log holds them
        # A write or fsync failed, so the log's end is in doubt (a cut line would hide every line
        # after it from a load), or none could be written at start: the next batch writes a fresh
        # log first.
        self._rewrite = True

    def load(self) -> list[Entry]:
        """Reads every entry left by an earlier process and starts a fresh log holding them
        (leftover temp files are dropped); the caller holds `lock`."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for path in self.directory.iterdir():
            if is_temp_name(path.name):
                path.unlink(missing_ok=True)
        self.entries = read(self.directory)
        self._live = {uid: _put_line(entry) for uid, entry in self.entries.items()}
        self._earlier = list(self.directory.glob("*.json"))
        try:
            self._write_fresh()
        except OSError as exc:
            # A full or read-only disk must not keep the provisioner from starting: its deletions
            # (which free space) never touch the journal. The next write tries again first.
            log.warning("could not rewrite the journal; every write will try again first", error=str(exc))
        return list(self.entries.values())

    def close(self) -> None:
        """Closes the log once the batch being written, if any, is done (a cancelled caller
        leaves its batch's thread running); every later write fails."""
        with self._io:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def get(self, uid: str) -> Entry | None:
        return self.entries.get(uid)

    async def put(self, entry: Entry, durable: bool = True) -> None:
        """Returns once the entry is on disk: only then may CreateVolume be sent. `durable=False`
        is for updates whose loss is harmless (the volume id: without it, clean-up repeats the
        journalled CreateVolume to learn it), saving an fsync."""
        if not entry.uid:
            raise ValueError("a journal entry needs its claim's UID")
        await self._commit(_Change(entry.uid, _put_line(entry), True, durable))
        self.entries[entry.uid] = entry

    async def remove(self, uid: str) -> None:
        """No fsync: an entry that survives a crash is only re-checked and removed again."""
        if self.entries.pop(uid, None) is not None:
            line = orjson.dumps({"remove": uid}, option=orjson.OPT_APPEND_NEWLINE)
            await self._commit(_Change(uid, line, False, durable=False))

    def _idle(self) -> bool:
        """No batch is being carried out and none waits to be."""
        return not self._changes and (self._committing is None or self._committing.done())

    async def _commit(self, change: _Change) -> None:
        if not change.durable and self._idle() and not self._rewrite:
            # Nothing to wait for and nothing to order behind: appending a line takes a few
            # microseconds, far less than the two thread hops of a batch (claims that come one at a
            # time, as under the client's QPS limit, would each pay them).
            error = self._append([change])[0]
            if error is not None:
                raise error
            return
        self._changes.append(change)
        if self._committing is None or self._committing.done():
            self._committing = asyncio.get_running_loop().create_task(self._commit_batches())
        # A caller that is cancelled stops waiting; its change is still carried out in its turn.
        await asyncio.shield(change.done)

    async def _commit_batches(self) -> None:
        while self._changes:
            batch, self._changes = self._changes, []
            try:
                errors = await asyncio.to_thread(self._carry_out, batch)
            except Exception as exc:
                errors = [exc] * len(batch)
            for change, error in zip(batch, errors, strict=True):
                if error is None:
                    change.done.set_result(None)
                else:
                    change.done.set_exception(error)

    def _carry_out(self, batch: list[_Change]) -> list[Exception | None]:
        """In a thread: the batch appended, then the log rewritten if it has grown long."""
        errors = self._append(batch)
        with self._io:
            if not self._closed and self._size > COMPACT_AT and 2 * self._live_size < self._size:
                try:
                    self._write_fresh()
                except OSError as exc:  # the batch is on disk all the same; the next one tries again
                    log.warning("could not rewrite the journal", error=str(exc))
        return errors

    def _append(self, batch: list[_Change]) -> list[Exception | None]:
        """The batch's lines in one write, and one fsync if any of them must be durable. A failure
        fails the whole batch (its lines share the write)."""
        data = b"".join(change.line for change in batch)
        with self._io:
            if self._closed:
                return [OSError(errno.EBADF, "the journal is closed")] * len(batch)
            try:
                if self._rewrite:
                    self._write_fresh()
                assert self._fd is not None  # a fresh log is open once _rewrite is False
                write_all(self._fd, data)
                if any(change.durable for change in batch):
                    os.fsync(self._fd)
            except OSError as exc:
                self._rewrite = True
                for change in batch:
                    if not change.is_put:  # the caller gave the entry up: a rewrite need not keep it
                        self._forget(change.uid)
                return [exc] * len(batch)
            self._size += len(data)
            for change in batch:
                if change.is_put:
                    self._live_size += len(change.line) - len(self._live.get(change.uid, b""))
                    self._live[change.uid] = change.line
                else:
                    self._forget(change.uid)
            return [None] * len(batch)

    def _forget(self, uid: str) -> None:
        self._live_size -= len(self._live.pop(uid, b""))

    def _write_fresh(self) -> None:
        """A log of the live entries alone, durably in place of the old one; appends go to it."""
        path = self.directory / LOG_NAME
        data = b"".join(self._live.values())
        self._rewrite = True  # until the new log is in place and open
        write_atomic(path, data)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._size, self._live_size = fd, len(data), len(data)
        self._rewrite = False
        if self._earlier:  # the earlier form's files, folded into the log, which is durable now
            for earlier in self._earlier:
                earlier.unlink(missing_ok=True)
            fsync_dir(self.directory)
            self._earlier = []
