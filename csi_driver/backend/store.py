"""Durable records: one JSON file per record, replaced atomically (temp file, fsync, rename, fsync
of the directory). A kill -9 at any instant leaves either the old or the new record, never a torn
one, so a restarted driver knows every volume, snapshot and staging that any RPC acknowledged.
Records fsync'd (durable) also survive a power loss."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from controller_runtime.files import fsync_dir, is_temp_name, write_atomic
from controller_runtime.logs import get_logger

log = get_logger("csi.store")


class _Dataclass(Protocol):
    __dataclass_fields__: ClassVar[dict[str, Any]]


R = TypeVar("R", bound=_Dataclass)


def write_json_atomic(path: Path, doc: dict[str, Any], *, durable: bool = True) -> None:
    write_atomic(path, json.dumps(doc, sort_keys=True, indent=1).encode(), durable=durable)


class RecordStore(Generic[R]):
    """Records of one dataclass type, keyed by a validated id (never a path component from a user)."""

    def __init__(self, directory: Path, cls: type[R], *, durable: bool = True) -> None:
        """`durable=False` skips the fsyncs: for records of what a power loss undoes anyway."""
        self.directory = directory
        self._cls = cls
        self._durable = durable
        self._fields = {f.name for f in dataclasses.fields(cls)}

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def load(self) -> dict[str, R]:
        """Reads every record; called once at start (blocking, before serving), by the process
        holding the state directory's lock."""
        self.directory.mkdir(parents=True, exist_ok=True)
        records: dict[str, R] = {}
        for path in sorted(self.directory.iterdir()):
            if is_temp_name(path.name):
                path.unlink()  # a write interrupted before its rename; the old record still stands
                continue
            if path.suffix != ".json":
                continue
            try:
                doc = json.loads(path.read_text())
                record = self._cls(**{k: v for k, v in doc.items() if k in self._fields})
            except (ValueError, TypeError) as e:
                log.error("unreadable state record, ignoring it", path=str(path), error=str(e))
                continue
            records[path.stem] = record
        return records

    async def put(self, key: str, record: R, *, durable: bool | None = None) -> None:
        """`durable` overrides the store's choice for one write."""
        doc = dataclasses.asdict(record)
        sync = self._durable if durable is None else durable
        await asyncio.to_thread(functools.partial(write_json_atomic, durable=sync), self._path(key), doc)

    async def delete(self, key: str) -> None:
        def _delete() -> None:
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()
                if self._durable:
                    fsync_dir(str(self.directory))

        await asyncio.to_thread(_delete)
