"""The loop device's queue settings, written into a directory standing in for /sys/block: what is
written, in which order, and that a missing or unwritable file only costs that one setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.loop_tuning import TUNING, QueueSettings, apply_queue

# As a loop device on a virtio disk has them after attach.
KERNEL = {
    "scheduler": "[mq-deadline] none kyber bfq",
    "rotational": "1",
    "wbt_lat_usec": "2000",
    "max_sectors_kb": "1280",
    "max_hw_sectors_kb": "1280",
    "nr_requests": "128",
    "read_ahead_kb": "2560",
}


@pytest.fixture
def sys_block(tmp_path: Path) -> Path:
    queue = tmp_path / "loop7" / "queue"
    queue.mkdir(parents=True)
    for name, value in KERNEL.items():
        (queue / name).write_text(value + "\n")
    return tmp_path


def queue_file(sys_block: Path, name: str) -> str:
    return (sys_block / "loop7" / "queue" / name).read_text().strip()


ALL = QueueSettings(
    scheduler="none", rotational=False, wbt_lat_usec=0, max_sectors_kb=1024, nr_requests=64, read_ahead_kb=128
)


def test_every_setting_is_written(sys_block: Path) -> None:
    applied = apply_queue("/dev/loop7", ALL, sys_block)
    expected = {
        "scheduler": "none",
        "rotational": "0",
        "wbt_lat_usec": "0",
        "max_sectors_kb": "1024",
        "nr_requests": "64",
        "read_ahead_kb": "128",
    }
    assert applied == expected
    assert {name: queue_file(sys_block, name) for name in expected} == expected


def test_the_scheduler_is_written_before_nr_requests() -> None:
    # nr_requests is bounded by the scheduler in use: writing it first could be refused.
    files = list(ALL.files())
    assert files.index("scheduler") < files.index("nr_requests")


def test_a_device_name_without_dev_works(sys_block: Path) -> None:
    assert apply_queue("loop7", QueueSettings(), sys_block)["scheduler"] == "none"
    assert queue_file(sys_block, "scheduler") == "none"


def test_unset_fields_are_left_to_the_kernel(sys_block: Path) -> None:
    settings = QueueSettings(scheduler=None, rotational=None, wbt_lat_usec=None, read_ahead_kb=512)
    assert apply_queue("loop7", settings, sys_block) == {"read_ahead_kb": "512"}
    assert queue_file(sys_block, "scheduler") == KERNEL["scheduler"]
    assert queue_file(sys_block, "rotational") == "1"


def test_a_value_already_set_is_not_written(sys_block: Path) -> None:
    # The active scheduler is the bracketed one; a write would have replaced the whole line.
    (sys_block / "loop7" / "queue" / "scheduler").write_text("[none] mq-deadline kyber bfq\n")
    assert apply_queue("loop7", QueueSettings(), sys_block)["scheduler"] == "none"
    assert queue_file(sys_block, "scheduler") == "[none] mq-deadline kyber bfq"


def test_max_sectors_is_clamped_to_what_the_device_allows(sys_block: Path) -> None:
    applied = apply_queue("loop7", QueueSettings(max_sectors_kb=4096), sys_block)
    assert applied["max_sectors_kb"] == "1280"


def test_a_missing_file_skips_only_that_setting(sys_block: Path) -> None:
    (sys_block / "loop7" / "queue" / "wbt_lat_usec").unlink()  # a kernel without writeback throttling
    applied = apply_queue("loop7", QueueSettings(), sys_block)
    assert applied == {"scheduler": "none", "rotational": "0"}


def test_an_unwritable_file_skips_only_that_setting(sys_block: Path) -> None:
    # A directory where the file should be fails reads and writes alike, as a read-only /sys
    # fails the write (root ignores a file's mode bits, so a chmod would not do).
    rotational = sys_block / "loop7" / "queue" / "rotational"
    rotational.unlink()
    rotational.mkdir()
    applied = apply_queue("loop7", QueueSettings(), sys_block)
    assert applied == {"scheduler": "none", "wbt_lat_usec": "0"}
    assert queue_file(sys_block, "scheduler") == "none"


def test_a_refused_value_skips_only_that_setting(sys_block: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = Path.write_text

    def write_text(self: Path, data: str, *args: object, **kwargs: object) -> int:
        if self.name == "nr_requests":
            raise OSError(22, "Invalid argument")  # as sysfs answers a value out of range
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_text", write_text)
    applied = apply_queue("loop7", QueueSettings(nr_requests=100000, read_ahead_kb=128), sys_block)
    assert "nr_requests" not in applied
    assert applied["read_ahead_kb"] == "128"
    assert queue_file(sys_block, "nr_requests") == "128"


def test_a_device_sysfs_does_not_show_is_no_error(sys_block: Path) -> None:
    assert apply_queue("loop99", QueueSettings(), sys_block) == {}


def test_the_chosen_tuning() -> None:
    # What the node plugin attaches with (bench.datapath measured it; docs/csi-driver.md).
    assert TUNING.block_size == 4096
    assert TUNING.direct_io is True
    assert TUNING.queue.files()["scheduler"] == "none"
