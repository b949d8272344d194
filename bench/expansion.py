"""bench/expansion: N bound claims resized at once, kubeloop's external-resizer side by side with the
Go kubernetes-csi external-resizer (built by `tools/build-binaries.sh external-resizer` at the
version pinned in tools/versions.env), both driving the same kubeloop CSI driver.

    python -m bench.expansion [--claims 20] [--rounds 5] [--scenarios default,unthrottled]

Each (scenario, side) gets a fresh etcd + kube-apiserver and a fresh driver (`--mode controller`,
pool in a temporary directory). N block volumes are created through the driver, each with a PV
bound to its claim (statuses written directly: no binder runs), in a StorageClass that allows
expansion. No pod uses them, so the driver needs no node step and the resizer finishes each resize
itself. The resizer under test starts; then every claim's request is raised at once (t0) and the
bench watches until each claim's status capacity shows the new size. Both sides run with the same
--kube-api-qps/-burst and --workers; `default` is the sidecar's defaults (QPS 5 / burst 10,
10 workers), `unthrottled` QPS 1000 / burst 2000.

Reported: total time and resizes per second, per-claim latency (request raised → status capacity)
p50/p99, failed claims, the resizer's peak RSS and CPU. Within a scenario the rounds run
kubeloop, then Go (bench/method.py). Prints a table and writes bench/results/expansion.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from controller_runtime.client import ApiClient
from controller_runtime.csi_client import CSIConnection
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.resources import (
    NAMESPACES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    STORAGE_CLASSES,
    Obj,
)
from controller_runtime.toolchain import REPO_ROOT, MissingBinaryError
from csi_driver import DRIVER_NAME
from kubeloop_grpc.csi import csi_pb2
from localstack.go_sidecars import RESIZER, go_sidecar_binary

from . import method
from .common import (
    control_plane,
    cpu_seconds,
    percentile,
    rss_bytes,
    start,
    start_controller_driver,
    stop_process,
)

NAMESPACE = "bench"
CLASS = "bench-expandable"
SCENARIOS = {"default": (5.0, 10), "unthrottled": (1000.0, 2000)}
# Small enough that `make bench` (5 rounds of each side, both scenarios) fits its 30 minutes on 2 cores.
CLAIMS_DEFAULT = 20
WORKERS = 10
FROM, TO = "16Mi", "32Mi"


@dataclass
class Run:
    scenario: str
    side: str
    claims: int
    qps: float
    burst: int
    workers: int
    total_s: float
    resizes_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    failed: int
    peak_rss_mib: float
    cpu_s: float


def go_binary() -> Path:
    try:
        return go_sidecar_binary(RESIZER)
    except MissingBinaryError as exc:
        raise SystemExit(str(exc)) from None


def resizer_argv(side: str, kubeconfig: Path, socket: Path, qps: float, burst: int) -> list[str]:
    common = [
        f"--kubeconfig={kubeconfig}",
        f"--csi-address={socket}",
        f"--kube-api-qps={qps:g}",
        f"--kube-api-burst={burst}",
        f"--workers={WORKERS}",
        "--timeout=10s",
    ]
    if side == "go":
        return [str(go_binary()), *common, "--v=1"]
    return [sys.executable, "-m", "external_resizer.main", *common, "-v=1"]


async def bound_claims(api: ApiClient, csi: CSIConnection, n: int) -> None:
    """N block volumes, each a PV bound to a claim, with both statuses Bound."""
    cap = csi_pb2.VolumeCapability(
        access_mode=csi_pb2.VolumeCapability.AccessMode(
            mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
        )
    )
    cap.block.SetInParent()
    sem = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        name = f"c{i:04d}"
        async with sem:
            rsp = await csi.controller.CreateVolume(
                csi_pb2.CreateVolumeRequest(
                    name=name,
                    capacity_range=csi_pb2.CapacityRange(required_bytes=16 << 20),
                    volume_capabilities=[cap],
                ),
                timeout=30,
            )
            spec = {
                "accessModes": ["ReadWriteOnce"],
                "volumeMode": "Block",
                "storageClassName": CLASS,
                "resources": {"requests": {"storage": FROM}},
                "volumeName": name,
            }
            claim = await api.create(
                PERSISTENT_VOLUME_CLAIMS, {"metadata": {"name": name}, "spec": spec}, NAMESPACE
            )
            pv = await api.create(
                PERSISTENT_VOLUMES,
                {
                    "metadata": {"name": name},
                    "spec": {
                        "capacity": {"storage": FROM},
                        "accessModes": ["ReadWriteOnce"],
                        "volumeMode": "Block",
                        "storageClassName": CLASS,
                        "persistentVolumeReclaimPolicy": "Retain",
                        "claimRef": {"namespace": NAMESPACE, "name": name, "uid": claim["metadata"]["uid"]},
                        "csi": {"driver": DRIVER_NAME, "volumeHandle": rsp.volume.volume_id},
                    },
                },
            )
            await api.update_status(PERSISTENT_VOLUMES, {**pv, "status": {"phase": "Bound"}})
            await api.update_status(
                PERSISTENT_VOLUME_CLAIMS,
                {
                    **claim,
                    "status": {
                        "phase": "Bound",
                        "accessModes": ["ReadWriteOnce"],
                        "capacity": {"storage": FROM},
                    },
                },
            )

    await asyncio.gather(*(one(i) for i in range(n)))


async def run_one(scenario: str, side: str, n: int) -> Run:
    qps, burst = SCENARIOS[scenario]
    logs = REPO_ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="be", dir="/tmp"))
    async with control_plane() as cp:
        api = await ApiClient.from_kubeconfig(str(cp.admin_kubeconfig), qps=0, burst=1)
        procs: list[asyncio.subprocess.Process] = []
        csi: CSIConnection | None = None
        try:
            driver, socket = await start_controller_driver(
                root, logs / f"expansion-{scenario}-{side}-driver.log"
            )
            procs.append(driver)
            csi = await CSIConnection.connect(f"unix://{socket}", timeout=30, wait=30)
            await api.create(NAMESPACES, {"metadata": {"name": NAMESPACE}})
            await api.create(
                STORAGE_CLASSES,
                {"metadata": {"name": CLASS}, "provisioner": DRIVER_NAME, "allowVolumeExpansion": True},
            )
            await bound_claims(api, csi, n)

            resizer = await start(
                resizer_argv(side, cp.admin_kubeconfig, socket, qps, burst),
                logs / f"expansion-{scenario}-{side}.log",
            )
            procs.append(resizer)
            await asyncio.sleep(3)  # both sidecars connect and sync their caches in well under 3 s

            raised: dict[str, float] = {}
            resized: dict[str, float] = {}
            done = asyncio.Event()

            def seen(pvc: Obj) -> None:
                name = pvc["metadata"]["name"]
                capacity = (pvc.get("status") or {}).get("capacity", {}).get("storage")
                if capacity == TO and name not in resized:
                    resized[name] = time.monotonic()
                    if len(resized) == n:
                        done.set()

            informer = SharedInformer(api, PERSISTENT_VOLUME_CLAIMS, namespace=NAMESPACE)
            informer.add_handler(EventHandler(seen, lambda _o, p: seen(p), None))
            informer.start()
            await informer.wait_for_sync()

            sem = asyncio.Semaphore(64)

            async def grow(i: int) -> None:
                name = f"c{i:04d}"
                async with sem:
                    raised[name] = time.monotonic()
                    await api.patch(
                        PERSISTENT_VOLUME_CLAIMS,
                        name,
                        {"spec": {"resources": {"requests": {"storage": TO}}}},
                        namespace=NAMESPACE,
                    )

            peak = 0
            t0 = time.monotonic()
            await asyncio.gather(*(grow(i) for i in range(n)))
            deadline = t0 + 900
            while not done.is_set() and time.monotonic() < deadline:
                with contextlib.suppress(FileNotFoundError, RuntimeError):
                    peak = max(peak, rss_bytes(resizer.pid))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.5)
            total = (max(resized.values()) if resized else time.monotonic()) - t0
            cpu = cpu_seconds(resizer.pid)
            await informer.stop()
            lat = [resized[k] - raised[k] for k in resized]
            return Run(
                scenario=scenario,
                side=side,
                claims=n,
                qps=qps,
                burst=burst,
                workers=WORKERS,
                total_s=round(total, 2),
                resizes_per_s=round(len(resized) / total, 2) if total else 0.0,
                latency_p50_s=round(percentile(lat, 50), 2) if lat else 0.0,
                latency_p99_s=round(percentile(lat, 99), 2) if lat else 0.0,
                failed=n - len(resized),
                peak_rss_mib=round(peak / (1 << 20), 1),
                cpu_s=round(cpu, 1),
            )
        finally:
            if csi is not None:
                await csi.close()
            for proc in reversed(procs):
                await stop_process(proc)
            await api.close()
            shutil.rmtree(root, ignore_errors=True)


BENCH = method.Bench(
    name="expansion",
    title="N bound claims raised 16Mi -> 32Mi at once -> status capacity 32Mi",
    sides={"kubeloop": "kubeloop external-resizer", "go": "Go external-resizer"},
    figures=method.claims_figures("resizes_per_s", "resizes/s"),
)


def main() -> None:
    go_binary()
    method.claims_main(BENCH, __doc__.split("\n\n")[0], SCENARIOS, CLAIMS_DEFAULT, run_one)


if __name__ == "__main__":
    main()
