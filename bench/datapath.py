"""The loop data path against the pool's own filesystem (issue 16): fio through an ext4 volume on a
loop device whose backing file lies in the pool directory, and fio on the pool's filesystem in the
same directory, alternating per round (bench/method.py).

Three figures, each with direct I/O on both sides so that neither is served from the page cache:
sequential write (1 MiB blocks, fsync at the end), sequential read (1 MiB) and 4 KiB random read
(libaio, several requests in flight). The ratio of each round is volume / pool.

A scenario is one way of setting up the loop device and its filesystem (`SETUPS`): `driver` is what
the node plugin did before tuning, `tuned` is bench/loop_tuning.TUNING, the others
change one thing each, to show what it is worth. Needs root, losetup, mkfs.ext4 and fio.

    python -m bench.datapath [--scenarios driver,tuned] [--rounds 5] [--size-mib 1024] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from csi_driver.backend import fs

from .loop_tuning import TUNING, LoopTuning, QueueSettings, apply_queue
from .method import Bench, Figure, Pair, add_rounds_arg, alternate, run

MiB = 1 << 20
# Headroom in the volume beyond the test file: ext4's metadata and journal.
VOLUME_SLACK = 512 * MiB

BENCH = Bench(
    name="datapath",
    title="fio through a loop-backed ext4 volume vs. the pool filesystem, direct I/O",
    sides={"kubeloop": "loop volume", "go": "pool filesystem"},
    figures=(
        Figure("write_mib_s", "seq write 1M + fsync MiB/s", "higher"),
        Figure("read_mib_s", "seq read 1M MiB/s", "higher"),
        Figure("randread_iops", "rand read 4k IOPS", "higher"),
    ),
)

# The kernel's choice for every queue file: the loop device as attached.
UNTUNED = QueueSettings(scheduler=None, rotational=None, wbt_lat_usec=None)


@dataclass(frozen=True)
class Setup:
    """How the volume's loop device is attached and its filesystem mounted."""

    tuning: LoopTuning
    mount_options: tuple[str, ...] = ()
    what: str = ""


DRIVER = LoopTuning(block_size=512, direct_io=True, queue=UNTUNED)


def queue(what: str, **settings: Any) -> Setup:
    """`driver` with some queue settings changed."""
    return Setup(dataclasses.replace(DRIVER, queue=dataclasses.replace(UNTUNED, **settings)), what=what)


SETUPS: dict[str, Setup] = {
    "driver": Setup(DRIVER, what="direct I/O, 512-byte blocks, queue as attached: the driver before tuning"),
    "dio-off": Setup(dataclasses.replace(DRIVER, direct_io=False), what="buffered I/O on the backing file"),
    "bs4096": Setup(dataclasses.replace(DRIVER, block_size=4096), what="--sector-size 4096"),
    "sched-none": queue("scheduler none", scheduler="none"),
    "nonrot": queue("rotational 0", rotational=False),
    "wbt-off": queue("wbt_lat_usec 0", wbt_lat_usec=0),
    "maxsect": queue("max_sectors_kb 4096 (clamped to max_hw_sectors_kb)", max_sectors_kb=4096),
    "nr-req": queue("nr_requests 256", nr_requests=256),
    "readahead": queue("read_ahead_kb 128", read_ahead_kb=128),
    "cpu-lean": queue("nomerges 2, iostats 0, rq_affinity 2", nomerges=2, iostats=False, rq_affinity=2),
    "noatime": Setup(DRIVER, mount_options=("noatime",), what="ext4 mounted noatime"),
    "tuned": Setup(TUNING, what="loop_tuning.TUNING"),
}
DEFAULT_SCENARIOS = "driver,tuned"


@dataclass
class Figures:
    write_mib_s: float
    read_mib_s: float
    randread_iops: float


@dataclass
class Params:
    size: int
    rand_seconds: int
    rand_depth: int
    seq_depth: int
    work: Path  # the pool directory: the baseline's file and the volume's backing file
    fio_args: list[str] = field(default_factory=list)


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def fio(p: Params, path: Path, name: str, *job: str) -> dict[str, Any]:
    """One fio job on `path`; its JSON result for that job."""
    argv = [
        "fio",
        f"--name={name}",
        f"--filename={path}",
        f"--size={p.size}",
        "--direct=1",
        "--ioengine=libaio",
        "--output-format=json",
        *job,
        *p.fio_args,
    ]
    doc = json.loads(sh(*argv))
    return dict(doc["jobs"][0])


def measure(p: Params, path: Path, before: Callable[[], None] = lambda: None) -> Figures:
    """The three figures on `path`; `before` runs ahead of each."""
    seq = [f"--iodepth={p.seq_depth}", "--bs=1M"]
    # overwrite: the file is laid out before the first round, so every round overwrites blocks the
    # pool (and the backing file) already hold instead of allocating, the same on both sides.
    before()
    w = fio(p, path, "seqwrite", "--rw=write", "--overwrite=1", "--end_fsync=1", *seq)
    before()
    r = fio(p, path, "seqread", "--rw=read", *seq)
    before()
    rr = fio(
        p,
        path,
        "randread",
        "--rw=randread",
        "--bs=4k",
        f"--iodepth={p.rand_depth}",
        f"--runtime={p.rand_seconds}",
        "--time_based",
    )
    return Figures(
        write_mib_s=round(w["write"]["bw_bytes"] / MiB, 1),
        read_mib_s=round(r["read"]["bw_bytes"] / MiB, 1),
        randread_iops=round(rr["read"]["iops"]),
    )


def drop_cached(path: Path) -> None:
    """Evicts a file's pages from the page cache: a loop device without direct I/O reads its
    backing file through it, and what the write pass left there would flatter the read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def volume(p: Params, setup: Setup) -> AsyncIterator[tuple[Path, Path]]:
    """A loop device on a sparse file in the pool directory, formatted like NodeStageVolume does
    and mounted; yields the backing file and the mountpoint."""
    back = p.work / "volume.img"
    mnt = p.work / "mnt"
    mnt.mkdir(exist_ok=True)
    back.touch(mode=0o600)
    os.truncate(back, p.size + VOLUME_SLACK)  # sparse, as CreateVolume makes it
    t = setup.tuning
    attach = ["losetup", "--find", "--show", f"--direct-io={'on' if t.direct_io else 'off'}"]
    device = sh(*attach, f"--sector-size={t.block_size}", str(back)).strip()
    try:
        apply_queue(device, t.queue)
        await fs.mkfs(device, "ext4")
        opts = ["-o", ",".join(setup.mount_options)] if setup.mount_options else []
        sh("mount", *opts, device, str(mnt))
        try:
            yield back, mnt
        finally:
            sh("umount", str(mnt))
    finally:
        sh("losetup", "--detach", device)
        back.unlink()


async def scenario(p: Params, name: str, rounds: int) -> list[Pair]:
    setup = SETUPS[name]
    base = p.work / "pool.dat"
    async with volume(p, setup) as (back, mnt):
        on_volume = mnt / "vol.dat"
        # Lay out both files (and fill the backing file) before the first measured round.
        for path in (base, on_volume):
            fio(p, path, "layout", "--rw=write", "--bs=1M", "--iodepth=4", "--end_fsync=1")

        async def one(side: str, _round: int) -> Figures:
            if side == "go":
                return measure(p, base)
            return measure(p, on_volume, functools.partial(drop_cached, back))

        try:
            return await alternate(rounds, one, f"{name}: ", flip=True)
        finally:
            base.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.datapath", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenarios",
        default=DEFAULT_SCENARIOS,
        help="comma-separated, 'all' for every one (default: %(default)s): "
        + "; ".join(f"{n}: {s.what}" for n, s in SETUPS.items()).replace("%", "%%"),
    )
    add_rounds_arg(parser)
    parser.add_argument("--size-mib", type=int, default=1024, help="file size per side (default: 1024)")
    parser.add_argument("--rand-seconds", type=int, default=6, help="random-read run per side (default: 6)")
    parser.add_argument("--rand-depth", type=int, default=16, help="random-read queue depth (default: 16)")
    parser.add_argument("--seq-depth", type=int, default=1, help="sequential queue depth (default: 1)")
    parser.add_argument("--dir", default="/var/tmp", help="the pool directory's parent (default: /var/tmp)")
    args = parser.parse_args()
    names = list(SETUPS) if args.scenarios == "all" else args.scenarios.split(",")
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(unknown)}")
    for tool in ("fio", "losetup", "mkfs.ext4"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is missing (tools/install-system-deps.sh installs it)")
    if os.geteuid() != 0:
        parser.error("needs root: it attaches a loop device and mounts it")

    with tempfile.TemporaryDirectory(prefix="kubeloop-datapath-", dir=args.dir) as tmp:
        p = Params(
            size=args.size_mib * MiB,
            rand_seconds=args.rand_seconds,
            rand_depth=args.rand_depth,
            seq_depth=args.seq_depth,
            work=Path(tmp),
        )
        params = {
            "size_mib": args.size_mib,
            "seq": f"1M qd{args.seq_depth}",
            "randread": f"4k qd{args.rand_depth} {args.rand_seconds}s",
            "pool_fs": sh("findmnt", "-n", "-o", "FSTYPE", "--target", tmp).strip(),
        }

        async def collect() -> dict[str, list[Pair]]:
            return {n: await scenario(p, n, args.rounds) for n in names}

        run(BENCH, params, collect)


if __name__ == "__main__":
    main()
