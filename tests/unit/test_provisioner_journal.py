"""The intent journal: one append-only log, changes that arrive together appended in one batch with
one fsync, a torn tail dropped at load, the journal's earlier file-per-entry form folded in, and
the log kept short by rewriting it."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from controller_runtime import files
from external_provisioner import journal as journal_module
from external_provisioner.journal import LOG_NAME, Entry, Journal, read
from external_provisioner.request import SecretRef, Topology, VolumeSpec

SPEC = VolumeSpec("pvc-u", 1, False, "ext4", [], ["ReadWriteOnce"], {})


def entry(uid: str) -> Entry:
    return Entry(uid, "ns", f"claim-{uid}", "fast", SPEC)


def uids(directory: Path) -> list[str]:
    return sorted(read(directory))


@pytest.fixture
def log_syncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every fsync of a journal's log (not of the temp files a rewrite fsyncs before renaming)."""
    synced: list[int] = []
    real = os.fsync

    def counting(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/" + LOG_NAME):
            synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return synced


async def test_a_burst_of_puts_shares_one_fsync(tmp_path: Path, log_syncs: list[int]) -> None:
    journal = Journal(tmp_path / "j")
    journal.load()
    await asyncio.gather(*(journal.put(entry(f"u{i}")) for i in range(50)))
    assert len(log_syncs) == 1  # one batch, one fsync, however many entries
    assert uids(tmp_path / "j") == sorted(f"u{i}" for i in range(50))
    # Removals carry no fsync; two writes of one claim in one batch land in their order.
    known = entry("late")
    known.volume_id = "vol-1"
    await asyncio.gather(
        *(journal.remove(f"u{i}") for i in range(1, 50)), journal.put(entry("late")), journal.put(known)
    )
    assert read(tmp_path / "j") == {"late": known, "u0": entry("u0")}
    assert set(journal.entries) == {"late", "u0"}
    # A later write starts a batch of its own: one fsync for each of the three batches.
    await journal.put(entry("next"))
    assert len(log_syncs) == 3
    journal.close()


async def test_a_failed_write_fails_its_batch_and_leaves_no_cut_line_before_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal(tmp_path / "j")
    journal.load()
    await journal.put(entry("a"))
    real = files.write_all

    def half_then_full(fd: int, data: bytes) -> None:
        real(fd, data[: len(data) // 2])  # a cut line in the log, as a full disk leaves it
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal_module, "write_all", half_then_full)
    results = await asyncio.gather(journal.put(entry("b")), journal.put(entry("c")), return_exceptions=True)
    assert all(isinstance(r, OSError) and "No space left" in str(r) for r in results)
    assert set(journal.entries) == {"a"}  # what is not on disk is not journalled
    monkeypatch.setattr(journal_module, "write_all", real)
    # The next batch starts a fresh log: a load reading up to the cut line would miss "d".
    await journal.put(entry("d"))
    await journal.remove("a")
    assert uids(tmp_path / "j") == ["d"]
    journal.close()


async def test_a_failed_fsync_fails_the_batch_and_the_log_is_rewritten_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = Journal(tmp_path / "j")
    journal.load()
    real = os.fsync

    def broken(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/" + LOG_NAME):
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", broken)
    durable, best_effort = await asyncio.gather(
        journal.put(entry("d")), journal.put(entry("e"), durable=False), return_exceptions=True
    )
    assert isinstance(durable, OSError) and isinstance(best_effort, OSError)  # one write, one fate
    assert not journal.entries
    monkeypatch.setattr(os, "fsync", real)
    await journal.put(entry("f"))
    assert uids(tmp_path / "j") == ["f"]  # the failed batch's lines are not in the fresh log
    journal.close()


async def test_a_cancelled_caller_leaves_its_change_to_the_batch(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.load()
    put = asyncio.create_task(journal.put(entry("c")))
    await asyncio.sleep(0)  # the change has joined a batch
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    await journal.put(entry("after"))  # committed after the cancelled caller's batch
    assert uids(tmp_path / "j") == ["after", "c"]
    journal.close()


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
    await journal.remove("a")  # nothing in flight: appended right away, no thread hop
    assert hops == 1 and uids(tmp_path / "j") == ["b"]
    # Behind a pending batch, a removal joins it rather than overtake it.
    await asyncio.gather(journal.put(entry("c")), journal.remove("b"))
    assert hops == 2 and batches[-1] == 2
    assert uids(tmp_path / "j") == ["c"]
    journal.close()


async def test_an_entry_is_written_as_its_to_json(tmp_path: Path) -> None:
    spec = VolumeSpec(
        "pvc-u", 1 << 40, False, "ext4", ["ro"], ["ReadWriteOnce"], {"k": "é\n"},
        secret=SecretRef("s", "ns"), topology=Topology([{"zone": "a"}], [{"zone": "a"}]),
        mutable_parameters={"iops": "10"},
    )  # fmt: skip
    known = Entry("u1", "ns", "claim", "fast", spec, volume_id="vol-1")
    journal = Journal(tmp_path / "j")
    journal.load()
    await journal.put(known)
    journal.close()
    lines = (tmp_path / "j" / LOG_NAME).read_bytes().splitlines()
    assert [json.loads(line) for line in lines] == [{"put": known.to_json()}]
    assert Journal(tmp_path / "j").load() == [known]


async def test_a_torn_tail_is_dropped_at_load_and_never_appended_after(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.load()
    await asyncio.gather(journal.put(entry("a")), journal.put(entry("b")))
    await journal.remove("a")
    journal.close()
    log = tmp_path / "j" / LOG_NAME
    whole = log.read_bytes()
    # What a power cut can leave after the last fsync: a cut line, zeroes, then lines (never
    # acknowledged, so never counted).
    later = b'{"put":' + json.dumps(entry("z").to_json()).encode() + b'}\n{"remove":"b"}\n'
    log.write_bytes(whole + later[:20] + b"\0" * 30 + b"\n" + later)
    assert uids(tmp_path / "j") == ["b"]
    restarted = Journal(tmp_path / "j")
    assert [e.uid for e in restarted.load()] == ["b"]
    assert log.read_bytes() == whole.splitlines(keepends=True)[1]  # a fresh log: b's line alone
    await restarted.put(entry("c"))
    assert uids(tmp_path / "j") == ["b", "c"]
    restarted.close()


async def test_the_earlier_file_per_entry_form_is_folded_into_the_log(tmp_path: Path) -> None:
    directory = tmp_path / "j"
    directory.mkdir()
    known = entry("old")
    known.volume_id = "vol-9"
    (directory / "old.json").write_bytes(json.dumps(known.to_json()).encode())
    (directory / "other.json").write_bytes(json.dumps(entry("other").to_json()).encode())
    (directory / files.temp_name(directory / "spare")).write_bytes(b"left by a killed writer")
    journal = Journal(directory)
    assert sorted(journal.load(), key=lambda e: e.uid) == [known, entry("other")]
    assert [p.name for p in directory.iterdir()] == [LOG_NAME]  # the files and the temp file gone
    await journal.remove("other")
    assert read(directory) == {"old": known}
    journal.close()


async def test_the_log_is_rewritten_once_mostly_dead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "COMPACT_AT", 4096)
    journal = Journal(tmp_path / "j")
    journal.load()
    await journal.put(entry("kept"))
    for i in range(100):
        await journal.put(entry(f"u{i}"))
        await journal.remove(f"u{i}")
    log = tmp_path / "j" / LOG_NAME
    # Without rewrites the log would hold 201 lines; with them it stays near the threshold.
    assert log.stat().st_size < 4096 + 2 * len(journal_module._put_line(entry("u99")))
    assert uids(tmp_path / "j") == ["kept"]
    await journal.put(entry("after"))
    journal.close()
    assert uids(tmp_path / "j") == ["after", "kept"]


async def test_a_full_disk_at_start_does_not_stop_the_load_and_the_first_write_rewrites(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "j"
    directory.mkdir()
    (directory / "old.json").write_bytes(json.dumps(entry("old").to_json()).encode())
    real = files.write_atomic  # what the journal calls

    def full(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal_module, "write_atomic", full)
    journal = Journal(directory)
    assert journal.load() == [entry("old")]  # the provisioner starts, and its deletions can free room
    with pytest.raises(OSError, match="No space left"):
        await journal.put(entry("new"))
    with pytest.raises(OSError, match="No space left"):
        await journal.remove("old")  # not even a removal appends to a log that was not rewritten
    assert (directory / "old.json").exists() and not (directory / LOG_NAME).exists()
    monkeypatch.setattr(journal_module, "write_atomic", real)
    await journal.put(entry("new"))
    assert [p.name for p in directory.iterdir()] == [LOG_NAME]  # the earlier form's file folded in
    assert uids(directory) == ["new"]
    journal.close()


async def test_a_closed_journal_refuses_writes_and_leaves_its_log(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.load()
    await journal.put(entry("a"))
    journal.close()
    before = (tmp_path / "j" / LOG_NAME).read_bytes()
    for write in (journal.put(entry("b")), journal.remove("a")):
        with pytest.raises(OSError, match="closed"):
            await write
    assert (tmp_path / "j" / LOG_NAME).read_bytes() == before
