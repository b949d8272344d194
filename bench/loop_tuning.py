"""Settings of a loop device that keep its data path close to the pool's filesystem (issue 16).

`python -m bench.datapath` measures each setting against the pool filesystem itself
(docs/benchmarks.md, "The loop data path"); `TUNING` holds the combination it chose. The block size
and direct I/O are given at attach; the queue settings are sysfs files of the attached device,
written by `apply_queue` right after. The node plugin does not apply them (docs/csi-driver.md,
"Data path": the gain is within the VM's noise, and the block size of a formatted volume cannot
change).

Every queue setting is a hint: a container may mount /sys read-only, and an older kernel may lack a
file or refuse a value. A device that cannot be tuned still works, only more slowly, so a failure
is logged and the other settings are still tried.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from controller_runtime.logs import get_logger

log = get_logger("bench.datapath")

SYS_BLOCK = Path("/sys/block")


@dataclass(frozen=True)
class QueueSettings:
    """Values for /sys/block/<loopN>/queue/<file>; None leaves the kernel's value."""

    # The loop device forwards every request to the backing file, whose own device schedules
    # them: a second elevator only adds latency.
    scheduler: str | None = "none"
    # A loop device reports rotational when its backing disk does (virtio disks always do), which
    # makes the block layer and ext4 optimise for seeks that a file on a file does not have.
    rotational: bool | None = False
    # Writeback throttling (wbt_lat_usec) delays the volume's writes on top of the backing
    # device's own throttling; 0 turns it off.
    wbt_lat_usec: int | None = 0
    # Largest request the loop device passes down; clamped to max_hw_sectors_kb.
    max_sectors_kb: int | None = None
    nr_requests: int | None = None
    read_ahead_kb: int | None = None
    # CPU per request: 2 stops trying to merge requests, iostats 0 stops the accounting,
    # rq_affinity 2 completes a request on the CPU that issued it.
    nomerges: int | None = None
    iostats: bool | None = None
    rq_affinity: int | None = None

    def files(self) -> dict[str, str]:
        """The sysfs files to write, in the order to write them: the scheduler first, because
        nr_requests is bounded by what the chosen scheduler allows."""
        values: dict[str, int | str | bool | None] = {
            "scheduler": self.scheduler,
            "rotational": self.rotational,
            "wbt_lat_usec": self.wbt_lat_usec,
            "max_sectors_kb": self.max_sectors_kb,
            "nr_requests": self.nr_requests,
            "read_ahead_kb": self.read_ahead_kb,
            "nomerges": self.nomerges,
            "iostats": self.iostats,
            "rq_affinity": self.rq_affinity,
        }
        return {name: _sysfs_value(v) for name, v in values.items() if v is not None}


@dataclass(frozen=True)
class LoopTuning:
    """How to attach a loop device: its logical block size and direct I/O (both LOOP_CONFIGURE
    parameters) and the queue settings to apply after."""

    # Matches the 4096-byte blocks of ext4 and xfs on the pool: with direct I/O the loop device
    # then never issues a request smaller than a pool block, so the pool never reads a block to
    # change part of it. A filesystem made on a 512-byte device may not mount on a 4096-byte one:
    # xfs records its 512-byte sector size, and mkfs.ext4 gives volumes under 512 MiB 1 KiB
    # blocks. A volume formatted before this setting needs the block size it was made with.
    block_size: int = 4096
    # Data is cached once, in the filesystem on the loop device, instead of twice.
    direct_io: bool = True
    queue: QueueSettings = field(default_factory=QueueSettings)


TUNING = LoopTuning()


def _sysfs_value(v: int | str | bool) -> str:
    return str(int(v)) if isinstance(v, bool) else str(v)


def _current(path: Path) -> str:
    """A queue file's value as written; for `scheduler` the bracketed, active one."""
    text = path.read_text().strip()
    if path.name == "scheduler" and "[" in text:
        return text.split("[", 1)[1].split("]", 1)[0]
    return text


def apply_queue(device: str, queue: QueueSettings, sys_block: Path = SYS_BLOCK) -> dict[str, str]:
    """Writes `queue` into <sys_block>/<loopN>/queue for `device` (/dev/loopN or loopN); returns
    the files it set or found already set. A file missing, read-only or refusing its value is
    logged and skipped; the device works without it."""
    name = Path(device).name
    qdir = sys_block / name / "queue"
    wanted = queue.files()
    if "max_sectors_kb" in wanted:
        try:
            hw_max = int((qdir / "max_hw_sectors_kb").read_text())
            wanted["max_sectors_kb"] = str(min(int(wanted["max_sectors_kb"]), hw_max))
        except (OSError, ValueError):
            pass  # the write below reports what is wrong
    applied: dict[str, str] = {}
    for file, value in wanted.items():
        path = qdir / file
        try:
            # A file already holding the value is not written: in a container with /sys mounted
            # read-only, the settings the kernel chose right need no write and no warning.
            if _current(path) != value:
                path.write_text(value)
            applied[file] = value
        except OSError as e:
            log.warning("cannot set a loop queue setting", device=name, file=file, value=value, error=str(e))
    if applied:
        log.info("tuned loop device queue", device=name, **applied)
    return applied
