"""Freezing staged filesystems so that a group snapshot is one moment of all its volumes.

A volume's filesystem is mounted by a node plugin, and the controller that copies the backing
files may be another process, in another container (shared mode). They meet in the pool:

    freezes/<request>.json          {"volumes": [...], "nodes": [...], "deadline": <epoch s>}
                                    written by the controller
    freezes/<request>.<node>.acked  written by a node plugin once it has frozen (FIFREEZE) each of
                                    the request's volumes it has staged as a filesystem

The controller waits for every node the volumes are published to, copies the backing files, and
removes the request; each node plugin thaws (FITHAW) when the request is gone or its deadline has
passed, so a controller killed mid-copy leaves no filesystem frozen for long, and a node plugin
that restarts thaws whatever it had frozen. A copy that outlived the deadline is not consistent
and is thrown away. Raw block volumes have no filesystem to freeze: their applications see the
moment of the copy of each, not one moment for all.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from controller_runtime.files import temp_name
from controller_runtime.logs import get_logger
from controller_runtime.mounts import is_mounted

from .errors import aborted
from .state import DriverState, StagingRecord

log = get_logger("csi.freeze")

_FIFREEZE = 0xC0045877
_FITHAW = 0xC0045878
POLL = 0.1  # how often a node plugin looks for requests, and the controller for answers
ACK_TIMEOUT = 15.0  # how long the controller waits for the nodes to freeze
HOLD = 60.0  # the longest a filesystem stays frozen for one request


def freeze(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _FIFREEZE, 0)
    finally:
        os.close(fd)


def thaw(path: str) -> bool:
    """Thaws a filesystem; False when it was not frozen."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _FITHAW, 0)
        return True
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)


def _write(path: Path, doc: dict[str, object]) -> None:
    tmp = Path(temp_name(str(path)))
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# --- the controller's side --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def quiesced(state: DriverState, request: str, volumes: dict[str, list[str]]) -> AsyncIterator[None]:
    """Holds the filesystems of `volumes` (volume id -> the nodes it is staged on) frozen while the
    body runs; ABORTED when a node did not answer in time, or when the body outlived the hold
    (the copies it made are then not one moment, and the caller throws them away)."""
    nodes = sorted({n for ns in volumes.values() for n in ns})
    if not nodes:
        yield  # staged nowhere: nothing writes to them
        return
    directory = state.freezes_dir
    path = directory / f"{request}.json"
    deadline = time.time() + HOLD
    doc = {"volumes": sorted(volumes), "nodes": nodes, "deadline": deadline}
    await asyncio.to_thread(_write, path, doc)
    try:
        waited = 0.0
        while missing := [n for n in nodes if not (directory / f"{request}.{n}.acked").exists()]:
            if waited >= ACK_TIMEOUT:
                raise aborted(
                    f"node(s) {', '.join(missing)} did not freeze the filesystems of the group's volumes "
                    f"within {ACK_TIMEOUT:.0f}s (is their node plugin running?); nothing was copied"
                )
            await asyncio.sleep(POLL)
            waited += POLL
        yield
        if time.time() >= deadline:
            raise aborted(
                f"copying the group's volumes took longer than the {HOLD:.0f}s their filesystems may stay "
                "frozen; the copies are discarded"
            )
    finally:
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(os.unlink, path)


# --- a node plugin's side ---------------------------------------------------------------------------


class FreezeWatcher:
    """Freezes this node's staged filesystems for the requests in the pool, and thaws them."""

    def __init__(self, state: DriverState, node_id: str) -> None:
        self.state, self.node_id = state, node_id
        self.frozen: dict[str, list[str]] = {}  # request -> staging paths this plugin froze

    def thaw_leftovers(self) -> None:
        """At start: a plugin killed while it held filesystems frozen leaves them so."""
        for rec in self.state.list_stagings():
            if rec.access_type == "mount" and is_mounted(rec.staging_path):
                with contextlib.suppress(OSError):
                    if thaw(rec.staging_path):
                        log.warning("thawed a filesystem frozen before a restart", volume=rec.volume_id)

    async def run(self) -> None:
        await asyncio.to_thread(self.thaw_leftovers)
        try:
            while True:
                try:
                    await self.pass_once()
                except OSError as e:
                    log.warning("freeze requests could not be read", error=str(e))
                await asyncio.sleep(POLL)
        finally:
            # Stopping (SIGTERM): nothing stays frozen behind this plugin.
            for paths in self.frozen.values():
                for path in paths:
                    with contextlib.suppress(OSError):
                        thaw(path)

    async def pass_once(self) -> None:
        directory = self.state.freezes_dir
        names = await asyncio.to_thread(lambda: [e.name for e in os.scandir(directory)])
        requests = {n.removesuffix(".json") for n in names if n.endswith(".json") and "." not in n[:-5]}
        now = time.time()
        for request in sorted(requests - set(self.frozen)):
            doc = await asyncio.to_thread(_read, directory / f"{request}.json")
            if doc is None or self.node_id not in (doc.get("nodes") or []):
                continue
            if float(doc.get("deadline") or 0) <= now:
                continue
            await self._freeze(request, [str(v) for v in doc.get("volumes") or []], float(doc["deadline"]))
        for request in sorted(set(self.frozen)):
            doc = await asyncio.to_thread(_read, directory / f"{request}.json")
            if doc is None or float(doc.get("deadline") or 0) <= now:
                await self._thaw(request)

    async def _freeze(self, request: str, volumes: Iterable[str], deadline: float) -> None:
        paths: list[str] = []
        self.frozen[request] = paths
        for volume_id in volumes:
            rec: StagingRecord | None = self.state.staging(volume_id)
            if rec is None or rec.access_type != "mount" or not is_mounted(rec.staging_path):
                continue
            try:
                await asyncio.to_thread(freeze, rec.staging_path)
            except OSError as e:
                if e.errno != errno.EBUSY:  # EBUSY: frozen already (another request)
                    log.error("could not freeze", volume=volume_id, error=str(e))
                    continue
            paths.append(rec.staging_path)
        ack = self.state.freezes_dir / f"{request}.{self.node_id}.acked"
        await asyncio.to_thread(_write, ack, {"frozen": paths, "deadline": deadline})
        log.info("froze filesystems for a group snapshot", request=request, volumes=len(paths))

    async def _thaw(self, request: str) -> None:
        for path in self.frozen.pop(request, []):
            try:
                await asyncio.to_thread(thaw, path)
            except OSError as e:
                log.error("could not thaw", path=path, error=str(e))
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(os.unlink, self.state.freezes_dir / f"{request}.{self.node_id}.acked")
        log.info("thawed filesystems", request=request)
