"""The pool's one capacity budget (`--capacity`), shared by every process that takes room from it.

Persistent volumes and snapshots are the controller side's; inline ephemeral volumes are made by
node plugins, in shared mode other processes with state directories of their own. All of them
take from one budget, so what decides lives in the pool, and one flock makes the decisions one at
a time (inside a process an asyncio lock comes first, so a process waits for its own decisions
in order and only one of its tasks waits for the flock):

    <pool>/.budget.lock          flock held while a process checks the room and writes what takes
                                 it; never renamed or deleted
    <pool>/budget.json           the controller side's --capacity and what its records hold, per
                                 kind: written (durably) before a record takes room and after one
                                 gives it back, so it never says less than the records hold
    <pool>/ephemeral/<id>.json   an inline volume's reservation (size, kind, node): written
                                 (durably) before its backing file is made, removed after the file

The controller counts its records and every reservation; a node plugin counts what budget.json
says and every reservation. Every writer of `ephemeral/` holds the flock while its temporary file
exists, so whoever holds it may sweep the temporary files a killed writer left there. Without
--capacity (or before any controller side has published budget.json) the pool is thin and the
pool filesystem's free space decides, as it always did.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from controller_runtime.files import fsync_dir, is_temp_name, remove_stale_temps
from controller_runtime.logs import get_logger

from .backend import files
from .backend.store import write_json_atomic
from .errors import exhausted, invalid
from .pool_kinds import KIND_PARAMETER, PoolCapacity, known_kinds
from .validation import check_id, format_size

log = get_logger("csi.budget")

LOCK_FILE = ".budget.lock"
BUDGET_FILE = "budget.json"
EPHEMERAL_DIR = "ephemeral"
RESERVATION_SUFFIX = ".json"


@dataclass(frozen=True)
class Reservation:
    """What an inline volume takes from the budget, from before its backing file exists until
    after it is gone."""

    volume_id: str
    size: int
    kind: str
    node: str


@dataclass(frozen=True)
class Room:
    """What a kind of the pool has left, and why."""

    left: int
    budget: int  # the kind's --capacity; 0 when the pool filesystem's free space decides
    held: int = 0  # by the controller side's volumes and snapshots
    inline: int = 0  # by inline volumes' reservations


def _published_capacity(doc: dict[str, Any]) -> PoolCapacity:
    return PoolCapacity(total=int(doc.get("capacity", 0)), kinds=dict(doc.get("kinds") or {}))


async def _flock(path: Path) -> int:
    """An exclusive flock on `path`, waited for in a thread. A caller cancelled while it waits
    does not leave the lock taken by nobody: the descriptor is closed once the thread has it."""

    def take() -> int:
        return files.flocked(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))

    waiting = asyncio.ensure_future(asyncio.to_thread(take))
    try:
        return await asyncio.shield(waiting)
    except asyncio.CancelledError:

        def close(done: asyncio.Future[int]) -> None:
            if not done.cancelled() and done.exception() is None:
                os.close(done.result())

        waiting.add_done_callback(close)
        raise


class PoolBudget:
    """One process's side of the pool's budget. `held(kind)` is what the controller side's records
    hold (every kind for None); `serve` says this process is the pool's controller side."""

    def __init__(self, pool_dir: Path, held: Callable[[str | None], int]) -> None:
        self.pool_dir = pool_dir
        self._held = held
        self._lock = asyncio.Lock()
        self.capacity: PoolCapacity | None = None
        self._published: dict[str, Any] | None = None

    # --- layout ---------------------------------------------------------------------------------
    @property
    def budget_file(self) -> Path:
        return self.pool_dir / BUDGET_FILE

    @property
    def ephemeral_dir(self) -> Path:
        return self.pool_dir / EPHEMERAL_DIR

    def reservation_file(self, volume_id: str) -> Path:
        return self.ephemeral_dir / f"{check_id(volume_id, 'volume_id')}{RESERVATION_SUFFIX}"

    @contextlib.asynccontextmanager
    async def deciding(self) -> AsyncIterator[None]:
        """Holds the pool's budget: no other decision, in this process or another, runs meanwhile."""
        async with self._lock:
            fd = await _flock(self.pool_dir / LOCK_FILE)
            try:
                yield
            finally:
                os.close(fd)

    # --- reservations (the pool's record of inline volumes) ---------------------------------------
    @staticmethod
    def _read_reservation(path: Path) -> Reservation | None:
        try:
            doc = json.loads(path.read_text())
            return Reservation(str(doc["volume_id"]), int(doc["size"]), str(doc["kind"]), str(doc["node"]))
        except FileNotFoundError:
            return None  # released meanwhile, or never made
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.error("unreadable inline volume reservation, not counted", path=str(path), error=str(e))
            return None

    def reservations(self) -> dict[str, Reservation]:
        """Every inline volume's reservation in the pool, whichever node made it."""
        found: dict[str, Reservation] = {}
        with contextlib.suppress(FileNotFoundError), os.scandir(self.ephemeral_dir) as entries:
            for entry in entries:
                if is_temp_name(entry.name) or not entry.name.endswith(RESERVATION_SUFFIX):
                    continue
                if (r := self._read_reservation(Path(entry.path))) is not None:
                    found[r.volume_id] = r
        return found

    def reservation(self, volume_id: str) -> Reservation | None:
        return self._read_reservation(self.reservation_file(volume_id))

    def _inline(self, kind: str | None) -> int:
        return sum(r.size for r in self.reservations().values() if kind in (None, r.kind))

    def reserve(self, r: Reservation) -> None:
        """Writes a reservation, durably. Call it under `deciding`, after checking the room."""
        write_json_atomic(self.reservation_file(r.volume_id), asdict(r))

    def release(self, volume_id: str) -> None:
        """Gives an inline volume's room back (after its backing file is gone); nothing if none."""
        path = self.reservation_file(volume_id)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        fsync_dir(path.parent)

    def sweep(self) -> list[str]:
        """Removes the temporary files killed writers left in ephemeral/. Only under `deciding`:
        every writer there holds the budget while its temporary file exists."""
        return remove_stale_temps(self.ephemeral_dir)

    # --- the controller side ----------------------------------------------------------------------
    def serve(self, capacity: PoolCapacity) -> None:
        """This process is the pool's controller side, with this --capacity."""
        self.capacity = capacity

    async def room(self, kind: str) -> Room:
        """What the controller side may still give a volume or snapshot of `kind` ("" without
        kinds): its --capacity less what its records and every inline reservation hold, or the
        pool filesystem's free space without --capacity."""
        capacity = self.capacity or PoolCapacity()
        if not capacity.budgeted:
            return Room(await asyncio.to_thread(files.free_bytes, str(self.pool_dir)), 0)
        scope = kind if capacity.kinds else None
        # A kind no longer configured (the flags changed since the volume was made) has none.
        budget = capacity.kinds.get(kind, 0) if capacity.kinds else capacity.total
        held = self._held(scope)
        inline = await asyncio.to_thread(self._inline, scope)
        return Room(max(0, budget - held - inline), budget, held, inline)

    def _doc(self, extra: tuple[str, int] | None = None) -> dict[str, Any]:
        capacity = self.capacity or PoolCapacity()
        held: dict[str, int] = {}
        if capacity.budgeted:
            for kind in capacity.kinds or {"": 0}:
                held[kind] = self._held(kind if capacity.kinds else None)
            if extra is not None:
                held[extra[0]] = held.get(extra[0], 0) + extra[1]
        return {"capacity": capacity.total, "kinds": dict(capacity.kinds), "held": held}

    async def _publish(self, extra: tuple[str, int] | None = None) -> None:
        """Writes budget.json when what it would say changed; only then is it remembered."""
        if self.capacity is None:
            return
        doc = self._doc(extra)
        if doc != self._published:
            await asyncio.to_thread(write_json_atomic, self.budget_file, doc)
            self._published = doc

    async def publish(self) -> None:
        """Says what the records hold now: at start, and after a record gave room back (a record
        going is safe to publish late: until then node plugins count it still)."""
        if self.capacity is None:
            return
        try:
            async with self.deciding():
                await self._publish()
        except OSError as e:  # it says more than the records hold: safe, and fixed at the next
            log.error("could not update the pool's budget file", error=str(e))

    @contextlib.asynccontextmanager
    async def holding(self, size: int, kind: str) -> AsyncIterator[None]:
        """Under `deciding`, around the write of a record that takes `size` more of `kind`: the
        node plugins learn of it before the record exists, and afterwards budget.json says what
        the records hold (the same, unless the write failed)."""
        if not (self.capacity and self.capacity.budgeted and size):
            yield
            return
        await self._publish((kind, size))
        try:
            yield
        finally:
            try:
                await self._publish()
            except OSError as e:  # it says more than the records hold: safe, and fixed at the next
                log.error("could not update the pool's budget file", error=str(e))

    # --- a node plugin's side ---------------------------------------------------------------------
    def _read_published(self) -> dict[str, Any] | None:
        try:
            doc = json.loads(self.budget_file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.error(
                "unreadable budget file; the pool's free space decides",
                path=str(self.budget_file),
                error=str(e),
            )
            return None
        return doc if isinstance(doc, dict) else None

    def check_inline(self, size: int, kind: str, node: str) -> None:
        """Whether an inline volume of `size` and `kind` fits; INVALID_ARGUMENT for a kind the pool
        lacks, RESOURCE_EXHAUSTED saying what holds the room. Under `deciding`."""
        doc = self._read_published()
        capacity = _published_capacity(doc) if doc is not None else PoolCapacity()
        if kind and kind not in capacity.kinds:
            raise invalid(
                f"volumeAttributes {KIND_PARAMETER}={kind[:100]!r} is not a pool kind of node {node}; "
                f"this pool's kinds: {known_kinds(capacity)}"
            )
        if capacity.kinds and not kind:
            raise invalid(
                f"the pool of node {node} is split into kinds ({known_kinds(capacity)}); choose one "
                f"with the inline volume's volumeAttributes {KIND_PARAMETER}"
            )
        if doc is None or not capacity.budgeted:
            free = files.free_bytes(str(self.pool_dir))
            if size > free:
                raise exhausted(
                    f"node {node} has {format_size(free)} free in its pool, less than the "
                    f"{format_size(size)} the inline volume asks for"
                )
            return
        budget = capacity.kinds[kind] if capacity.kinds else capacity.total
        held_by = doc.get("held") or {}
        held = int(held_by.get(kind, 0)) if capacity.kinds else sum(int(v) for v in held_by.values())
        inline = self._inline(kind if capacity.kinds else None)
        left = max(0, budget - held - inline)
        if size > left:
            where = f"--capacity {f'{kind}=' if kind else ''}{format_size(budget)}"
            raise exhausted(
                f"node {node} cannot make an inline volume of {format_size(size)}: the pool's {where} "
                f"has {format_size(left)} left ({format_size(held)} held by persistent volumes and "
                f"snapshots, {format_size(inline)} by inline volumes)"
            )

    @contextlib.asynccontextmanager
    async def reserving_inline(self, volume_id: str, size: int, kind: str, node: str) -> AsyncIterator[None]:
        """Checks that an inline volume fits and reserves its room (unless a reservation for it
        exists already: a publish resumed after a crash), then holds the budget while the caller
        makes its backing file. The caller gives the room back with `release` once the file is
        gone, also when the publish fails."""
        async with self.deciding():
            if await asyncio.to_thread(self.reservation, volume_id) is None:
                await asyncio.to_thread(self.check_inline, size, kind, node)
                await asyncio.to_thread(self.reserve, Reservation(volume_id, size, kind, node))
            yield
