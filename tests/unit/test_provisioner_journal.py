"""The intent journal's group commit: changes that arrive together are carried out in one batch,
in order, with one directory fsync, and each caller hears only of its own change's outcome."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from controller_runtime import files
from external_provisioner import journal as journal_module
from external_provisioner.journal import Entry, Journal
from external_provisioner.request import SecretRef, Topology, VolumeSpec

SPEC = VolumeSpec("pvc-u", 1, False, "ext4", [], ["ReadWriteOnce"], {})


def entry(uid: str) -> Entry:
    return Entry(uid, "ns", f"claim-{uid}", "fast", SPEC)


@pytest.fixture
def dir_syncs(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    synced: list[Path] = []
    real = files.fsync_dir

    def counting(path: str | Path) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(journal_module, "fsync_dir", counting)
    return synced


async def test_a_burst_of_puts_shares_one_directory_fsync(tmp_path: Path, dir_syncs: list[Path]) -> None:
    journal = Journal(tmp_path / "j")
    journal.load()
    await asyncio.gather(*(journal.put(entry(f"u{i}")) for i in range(50)))
    assert dir_syncs == [tmp_path / "j"]  # one batch, one fsync, however many entries
    assert sorted(e.uid for e in Journal(tmp_path / "j").load()) == sorted(f"u{i}" for i in range(50))
    # Removals carry no fsync; two writes of one claim in one batch land in their order.
    known = entry("late")
    known.volume_id = "vol-1"
    await asyncio.gather(
        *(journal.remove(f"u{i}") for i in range(1, 50)), journal.put(entry("late")), journal.put(known)
    )
    assert sorted(Journal(tmp_path / "j").load(), key=lambda e: e.uid) == [known, entry("u0")]
    assert set(journal.entries) == {"late", "u0"}
    # A later write starts a batch of its own: one fsync for each of the three batches.
    await journal.put(entry("next"))
    assert len(dir_syncs) == 3


async def test_a_failed_write_fails_its_own_caller_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dir_syncs: list[Path]
) -> None:
    journal = Journal(tmp_path / "j")
    journal.load()
    real = files.write_atomic

    def failing(path: Path, data: bytes, **kwargs: Any) -> None:
        if path.name == "bad.json":
            raise OSError(28, "No space left on device")
        real(path, data, **kwargs)

    monkeypatch.setattr(journal_module, "write_atomic", failing)
    results = await asyncio.gather(
        journal.put(entry("a")), journal.put(entry("bad")), journal.put(entry("b")), return_exceptions=True
    )
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], OSError) and "No space left" in str(results[1])
    assert set(journal.entries) == {"a", "b"}  # what is not on disk is not journalled
    assert sorted(e.uid for e in Journal(tmp_path / "j").load()) == ["a", "b"]


async def test_a_failed_directory_fsync_fails_the_durable_writes_of_its_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal(tmp_path / "j")
    journal.load()

    def broken(_path: str | Path) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(journal_module, "fsync_dir", broken)
    durable, best_effort = await asyncio.gather(
        journal.put(entry("d")), journal.put(entry("e"), durable=False), return_exceptions=True
    )
    assert isinstance(durable, OSError) and best_effort is None
    assert set(journal.entries) == {"e"}


async def test_a_cancelled_caller_leaves_its_change_to_the_batch(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.load()
    put = asyncio.create_task(journal.put(entry("c")))
    await asyncio.sleep(0)  # the change has joined a batch
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    await journal.put(entry("after"))  # committed after the cancelled caller's batch
    assert sorted(e.uid for e in Journal(tmp_path / "j").load()) == ["after", "c"]


async def test_a_lone_removal_skips_the_thread_but_waits_behind_a_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal(tmp_path / "j")
    journal.load()
    batches: list[int] = []
    real = journal._carry_out

    def counting(batch: list[journal_module._Change]) -> list[Exception | None]:
        batches.append(len(batch))
        return real(batch)

    monkeypatch.setattr(journal, "_carry_out", counting)
    hops = 0
    to_thread = asyncio.to_thread

    async def hop(*args: object) -> object:
        nonlocal hops
        hops += 1
        return await to_thread(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(asyncio, "to_thread", hop)
    await asyncio.gather(journal.put(entry("a")), journal.put(entry("b")))
    assert hops == 1  # the durable writes: one batch on the thread
    await journal.remove("a")  # nothing in flight: carried out right away, no thread hop
    assert hops == 1 and not (tmp_path / "j" / "a.json").exists()
    # Behind a pending batch, a removal joins it rather than overtake it.
    await asyncio.gather(journal.put(entry("c")), journal.remove("b"))
    assert hops == 2 and batches[-1] == 2
    assert sorted(e.uid for e in Journal(tmp_path / "j").load()) == ["c"]


async def test_an_entry_is_written_as_its_to_json(tmp_path: Path) -> None:
    spec = VolumeSpec(
        "pvc-u", 1 << 40, False, "ext4", ["ro"], ["ReadWriteOnce"], {"k": "é"},
        secret=SecretRef("s", "ns"), topology=Topology([{"zone": "a"}], [{"zone": "a"}]),
        mutable_parameters={"iops": "10"},
    )  # fmt: skip
    known = Entry("u1", "ns", "claim", "fast", spec, volume_id="vol-1")
    journal = Journal(tmp_path / "j")
    journal.load()
    await journal.put(known)
    assert json.loads((tmp_path / "j" / "u1.json").read_bytes()) == known.to_json()
    assert Journal(tmp_path / "j").load() == [known]


async def test_removed_files_are_written_into_again_and_dropped_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal(tmp_path / "j")
    journal.load()
    await asyncio.gather(*(journal.put(entry(f"u{i}")) for i in range(3)))
    await asyncio.gather(*(journal.remove(f"u{i}") for i in range(3)))
    spares = sorted(p.name for p in (tmp_path / "j").iterdir() if files.is_temp_name(p.name))
    assert len(spares) == 3 and not list((tmp_path / "j").glob("*.json"))
    inodes = {p.stat().st_ino for p in (tmp_path / "j").iterdir() if files.is_temp_name(p.name)}
    longer = entry("long")
    longer.volume_id = "v" * 200
    await asyncio.gather(journal.put(entry("a")), journal.put(longer), journal.put(entry("b")))
    # The three entries are the three removed files, rewritten: no file created.
    assert {p.stat().st_ino for p in (tmp_path / "j").glob("*.json")} == inodes
    assert sorted(Journal(tmp_path / "j").load(), key=lambda e: e.uid) == [entry("a"), entry("b"), longer]
    # Shorter content than a spare held is cut to its length (load above parsed every file).
    monkeypatch.setattr(journal_module, "SPARES", 1)
    await asyncio.gather(journal.remove("a"), journal.remove("b"))  # room for one spare: one unlinked
    await asyncio.gather(journal.put(entry("c")), journal.put(entry("d")))  # one spare, one new file
    assert sorted(Journal(tmp_path / "j").load(), key=lambda e: e.uid) == [entry("c"), entry("d"), longer]
    # A new process's load drops the spares left by this one, as any temp file; a spare gone
    # from under its journal is passed over.
    await journal.remove("c")
    assert [p for p in (tmp_path / "j").iterdir() if files.is_temp_name(p.name)]
    assert sorted(Journal(tmp_path / "j").load(), key=lambda e: e.uid) == [entry("d"), longer]
    assert not [p for p in (tmp_path / "j").iterdir() if files.is_temp_name(p.name)]
    await journal.put(entry("e"))
    assert sorted(Journal(tmp_path / "j").load(), key=lambda e: e.uid) == [entry("d"), entry("e"), longer]
