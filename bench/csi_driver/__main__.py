"""Benchmark of the CSI driver on real loop devices (run as root): `python -m bench.csi_driver`.

Measures, against one `--mode all` driver over its unix socket:
  * CreateVolume latency (1 GiB), p50/p99;
  * stage+publish latency (NodeStageVolume + NodePublishVolume) of a fresh 1 GiB ext4 volume, p50/p99;
  * sequential write and read throughput through a published volume versus the same I/O on the
    pool's own filesystem, both with O_DIRECT (no page cache on either side) and an fsync.
Prints a table and writes bench/results/csi_driver.json.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from bench.common import median, percentile, print_table, write_results
from controller_runtime.toolchain import REPO_ROOT
from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc

GiB, MiB = 1 << 30, 1 << 20
TARGETS = {"create_p99_ms": 50.0, "stage_publish_p99_ms": 1000.0, "throughput_ratio": 0.90}
MOUNT = csi_pb2.VolumeCapability(
    mount=csi_pb2.VolumeCapability.MountVolume(fs_type="ext4"),
    access_mode=csi_pb2.VolumeCapability.AccessMode(
        mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
    ),
)
NODE = "bench-node"


class Driver:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.socket = work / "csi.sock"
        self.pool = work / "pool"
        cmd = [
            sys.executable,
            "-m",
            "csi_driver.main",
            "--mode",
            "all",
            "--node-id",
            NODE,
            "--endpoint",
            f"unix://{self.socket}",
            "--pool-dir",
            str(self.pool),
            "--state-dir",
            str(work / "state"),
            "--kubelet-dir",
            str(work),
            "--max-volumes-per-node",
            "0",
            "-v",
            "1",
        ]
        self.log = open(work / "driver.log", "wb")  # noqa: SIM115 - lives as long as the driver
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"driver did not start; see {work / 'driver.log'}")
            time.sleep(0.05)
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        grpc.channel_ready_future(self.channel).result(timeout=10)
        self.controller = csi_pb2_grpc.ControllerStub(self.channel)
        self.node = csi_pb2_grpc.NodeStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        self.log.close()


def timed(fn: Callable[..., Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def create_volume(d: Driver, name: str, size: int = GiB) -> str:
    return str(
        d.controller.CreateVolume(
            csi_pb2.CreateVolumeRequest(
                name=name,
                capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                volume_capabilities=[MOUNT],
            )
        ).volume.volume_id
    )


def paths(d: Driver, vid: str) -> tuple[str, str]:
    staging, target = d.work / "staging" / vid, d.work / "pods" / vid / "mount"
    staging.mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    return str(staging), str(target)


def stage_publish(d: Driver, vid: str) -> None:
    staging, target = paths(d, vid)
    d.node.NodeStageVolume(
        csi_pb2.NodeStageVolumeRequest(volume_id=vid, staging_target_path=staging, volume_capability=MOUNT)
    )
    d.node.NodePublishVolume(
        csi_pb2.NodePublishVolumeRequest(
            volume_id=vid, staging_target_path=staging, target_path=target, volume_capability=MOUNT
        )
    )


def teardown(d: Driver, vid: str) -> None:
    staging, target = paths(d, vid)
    d.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path=target))
    d.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(volume_id=vid, staging_target_path=staging))
    d.controller.ControllerUnpublishVolume(
        csi_pb2.ControllerUnpublishVolumeRequest(volume_id=vid, node_id=NODE)
    )
    d.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vid))


def sequential(path: str, size: int, block: int, write: bool) -> float:
    """MB/s of one O_DIRECT pass over `path` (written with fsync, or read)."""
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    # No O_TRUNC: after the first pass both sides overwrite allocated blocks. (Truncating would
    # make ext4 on the volume reuse blocks the sparse backing file already holds, while the pool
    # side allocates afresh every pass, which flatters the volume.)
    flags = os.O_DIRECT | (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY)
    fd = os.open(path, flags, 0o600)
    try:
        start = time.perf_counter()
        done = 0
        while done < size:
            n = os.pwritev(fd, [buf], done) if write else os.preadv(fd, [buf], done)
            if n <= 0:
                raise OSError(f"short I/O at {done} on {path}")
            done += n
        if write:
            os.fsync(fd)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
        buf.close()
    return size / elapsed / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.csi_driver", description=__doc__.splitlines()[0])
    parser.add_argument("--creates", type=int, default=100, help="CreateVolume samples (default: 100)")
    parser.add_argument("--stages", type=int, default=30, help="stage+publish samples (default: 30)")
    parser.add_argument("--io-size", type=int, default=2048, help="MiB per throughput pass (default: 2048)")
    parser.add_argument("--io-rounds", type=int, default=7, help="passes per side, median kept (default: 7)")
    parser.add_argument("--dir", default="/var/tmp", help="where the pool lives (default: /var/tmp)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the CSI benchmark needs root (loop devices, mount)")

    work = Path(tempfile.mkdtemp(prefix="kl-bench-", dir=args.dir))
    d = Driver(work)
    try:
        # 1. CreateVolume of 1 GiB (sparse file + durable record)
        create_ms, vids = [], []
        for i in range(args.creates):
            holder: list[str] = []
            create_ms.append(timed(lambda i=i, h=holder: h.append(create_volume(d, f"bench-create-{i}"))))
            vids.append(holder[0])
        for vid in vids:
            d.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vid))

        # 2. stage+publish of a fresh 1 GiB volume (losetup, blkid, mkfs.ext4, mount, bind mount)
        stage_ms = []
        for i in range(args.stages):
            vid = create_volume(d, f"bench-stage-{i}")
            d.controller.ControllerPublishVolume(
                csi_pb2.ControllerPublishVolumeRequest(volume_id=vid, node_id=NODE, volume_capability=MOUNT)
            )
            stage_ms.append(timed(lambda vid=vid: stage_publish(d, vid)))
            teardown(d, vid)

        # 3. throughput: through a published volume vs. directly on the pool's filesystem
        size, block = args.io_size * MiB, 4 * MiB
        # Passes of a second or more each: this much I/O keeps the noise of a shared VM disk small.
        vid = create_volume(d, "bench-io", size + GiB)
        d.controller.ControllerPublishVolume(
            csi_pb2.ControllerPublishVolumeRequest(volume_id=vid, node_id=NODE, volume_capability=MOUNT)
        )
        stage_publish(d, vid)
        _, target = paths(d, vid)
        on_volume, on_pool = os.path.join(target, "seq.dat"), str(d.pool / "seq.dat")
        rates: dict[str, list[float]] = {k: [] for k in ("vol_write", "pool_write", "vol_read", "pool_read")}
        try:
            # Interleaved, and the side that goes first alternates: on a VM disk the host is still
            # flushing the previous writer's data, and that cost must not always hit the same side.
            sides = [("pool", on_pool), ("vol", on_volume)]
            for n in range(args.io_rounds):
                order = sides if n % 2 == 0 else sides[::-1]
                for mode in ("write", "read"):
                    for side, path in order:
                        rates[f"{side}_{mode}"].append(sequential(path, size, block, write=mode == "write"))
        finally:
            os.unlink(on_pool)
            os.unlink(on_volume)
            teardown(d, vid)
    finally:
        d.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)

    mb = {k: median(v) for k, v in rates.items()}
    result: dict[str, Any] = {
        "create_volume_ms": {
            "p50": percentile(create_ms, 50),
            "p99": percentile(create_ms, 99),
            "n": len(create_ms),
        },
        "stage_publish_ms": {
            "p50": percentile(stage_ms, 50),
            "p99": percentile(stage_ms, 99),
            "n": len(stage_ms),
        },
        "throughput_samples_mb_s": rates,
        "throughput_mb_s": {
            **mb,
            "io_mib": args.io_size,
            "block_mib": block // MiB,
            "rounds": args.io_rounds,
            "o_direct": True,
        },
        "throughput_ratio": {
            "write": mb["vol_write"] / mb["pool_write"],
            "read": mb["vol_read"] / mb["pool_read"],
        },
        "targets": TARGETS,
    }
    ok = {
        "create": result["create_volume_ms"]["p99"] < TARGETS["create_p99_ms"],
        "stage": result["stage_publish_ms"]["p99"] < TARGETS["stage_publish_p99_ms"],
        "write": result["throughput_ratio"]["write"] >= TARGETS["throughput_ratio"],
        "read": result["throughput_ratio"]["read"] >= TARGETS["throughput_ratio"],
    }
    result["met"] = ok

    def verdict(key: str) -> str:
        return "ok" if ok[key] else "MISSED"

    cv, sp = result["create_volume_ms"], result["stage_publish_ms"]
    print_table(
        "CSI driver (loop devices), one --mode all driver over a unix socket",
        ["measure", "p50 / volume", "p99 / pool", "target", "verdict"],
        [
            [
                "CreateVolume 1 GiB (ms)",
                f"{cv['p50']:.1f}",
                f"{cv['p99']:.1f}",
                "p99 < 50",
                verdict("create"),
            ],
            [
                "stage+publish 1 GiB ext4 (ms)",
                f"{sp['p50']:.1f}",
                f"{sp['p99']:.1f}",
                "p99 < 1000",
                verdict("stage"),
            ],
            [
                "seq write O_DIRECT (MB/s)",
                f"{mb['vol_write']:.0f}",
                f"{mb['pool_write']:.0f}",
                f"≥ 90% ({result['throughput_ratio']['write']:.0%})",
                verdict("write"),
            ],
            [
                "seq read O_DIRECT (MB/s)",
                f"{mb['vol_read']:.0f}",
                f"{mb['pool_read']:.0f}",
                f"≥ 90% ({result['throughput_ratio']['read']:.0%})",
                verdict("read"),
            ],
        ],
    )
    written = write_results("csi_driver", result)
    print(f"\nwrote {written}")


if __name__ == "__main__":
    main()
