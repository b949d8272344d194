"""bench/provisioning: dynamic provisioning of N claims created at once, kubeloop's
external-provisioner side by side with the Go kubernetes-csi external-provisioner (v6.3.x, built
by `tools/build-binaries.sh external-provisioner`), both driving the same kubeloop CSI driver.

    python -m bench.provisioning [--claims 40] [--rounds 5] [--scenarios default,unthrottled]

Each (scenario, side) gets a fresh etcd + kube-apiserver, a fresh driver (`--mode controller`,
pool in a temporary directory) and kubeloop's pv-controller as a subprocess with a generous QPS and
16 binds in flight (it completes the binds for both sides, and must not be the bottleneck: with its
default of one bind in flight it was, and both sides bound claims at its pace). The provisioner under test
starts and becomes ready (the bench waits for the ready line each component logs, and at least
3 s: on a busy machine a start-up could otherwise still be running when the claims arrive, and be
counted as provisioning time); then N claims of an Immediate class are created at once (t0) and the
bench watches until every claim is Bound. Both sides run with the same --kube-api-qps/-burst and
--worker-threads; `default` is the sidecar's defaults (QPS 5 / burst 10, 100 workers),
`unthrottled` QPS 1000 / burst 2000.

Reported: total time and claims per second, per-claim latency (created → Bound) p50/p99, failed
claims (not Bound in time), the sidecar's peak RSS and CPU, and its start-up (process start to
its ready line); and the work per claim (bench.work): API requests the apiserver served and CSI
calls the driver served from the first create to the last bind, in total and by verb and resource
or by RPC (the records in the JSON). Within a scenario the rounds run
kubeloop, then Go (bench/method.py). Prints a table and writes bench/results/provisioning.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller_runtime.client import ApiClient
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.resources import (
    CSI_NODES,
    NAMESPACES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    STORAGE_CLASSES,
    Obj,
)
from controller_runtime.toolchain import REPO_ROOT, MissingBinaryError
from csi_driver import DRIVER_NAME, TOPOLOGY_KEY
from localstack.go_sidecars import PROVISIONER, go_sidecar_binary
from localstack.proc import free_ports

from . import method
from .common import (
    CpuUse,
    LogMark,
    control_plane,
    cpu_seconds,
    percentile,
    rss_bytes,
    start,
    start_controller_driver,
    stop_process,
    wait_log,
)
from .work import WorkCounts

NAMESPACE = "bench"
CLASS = "bench-immediate"
SCENARIOS = {"default": (5.0, 10), "unthrottled": (1000.0, 2000)}
# What each component logs once its caches are synced and its workers run.
READY = {
    "kubeloop": "caches synced, starting workers",
    "go": "Started provisioner controller",
    "pv-controller": "first pass over volumes done, starting claim workers",
}
# Small enough that `make bench` (5 rounds of each side, both scenarios) fits its 30 minutes on 2 cores.
CLAIMS_DEFAULT = 40
WORKERS = 100


@dataclass
class Run:
    scenario: str
    side: str
    claims: int
    qps: float
    burst: int
    workers: int
    total_s: float
    claims_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    failed: int
    peak_rss_mib: float
    cpu_s: float  # the sidecar's user+system CPU over the whole run
    ready_s: float  # the sidecar's start-up: process start to its ready line
    # CPU seconds from the first claim's creation to the last claim Bound: the sidecar's, then
    # what both sides share (the CSI driver, the pv-controller that binds, kube-apiserver and etcd).
    # Beside 2 cores x total_s, they show how much of the machine the shared part leaves.
    window_cpu_s: float = math.nan
    driver_cpu_s: float = math.nan
    binder_cpu_s: float = math.nan
    server_cpu_s: float = math.nan
    # Work per claim in the same window (bench.work): totals, and by kind.
    api_requests_per_op: float = math.nan
    csi_calls_per_op: float = math.nan
    api_requests: dict[str, float] = field(default_factory=dict)
    csi_calls: dict[str, float] = field(default_factory=dict)
    # The apiserver's mean time serving each kind of request (ms): its share of their latency.
    api_server_ms: dict[str, float] = field(default_factory=dict)
    # The mean wait for a seat in the apiserver's flow control, by priority level (ms).
    flow_control_wait_ms: dict[str, float] = field(default_factory=dict)


def go_binary() -> Path:
    try:
        return go_sidecar_binary(PROVISIONER)
    except MissingBinaryError as exc:
        raise SystemExit(str(exc)) from None


def provisioner_argv(
    side: str, kubeconfig: Path, socket: Path, qps: float, burst: int, state: Path
) -> list[str]:
    common = [
        f"--kubeconfig={kubeconfig}",
        f"--csi-address={socket}",
        f"--kube-api-qps={qps:g}",
        f"--kube-api-burst={burst}",
        f"--worker-threads={WORKERS}",
        "--timeout=10s",
    ]
    if side == "go":
        return [str(go_binary()), *common, "--v=1"]
    return [sys.executable, "-m", "external_provisioner.main", *common, f"--state-dir={state}", "-v=1"]


async def start_binder(kubeconfig: Path, log: Path) -> tuple[asyncio.subprocess.Process, LogMark]:
    """kubeloop's pv-controller, which completes the binds for both sides: a generous QPS and 16
    binds in flight, so it is not the bottleneck. Returns it and where its log started."""
    mark = LogMark.here(log)
    argv = [
        sys.executable,
        "-m",
        "services.pv_controller.main",
        f"--kubeconfig={kubeconfig}",
        "--kube-api-qps=5000",
        "--kube-api-burst=10000",
        "--worker-threads=16",
        "--binds-in-flight=16",
        "-v=1",
    ]
    return await start(argv, log), mark


def claim_figures(n: int, total: float, created: dict[str, float], bound: dict[str, float]) -> dict[str, Any]:
    """A run's figures over N claims: total time, rate, latency (created -> Bound) and failures."""
    lat = [bound[k] - created[k] for k in bound]
    return {
        "total_s": round(total, 2),
        "claims_per_s": round(len(bound) / total, 2) if total else 0.0,
        "latency_p50_s": round(percentile(lat, 50), 2) if lat else 0.0,
        "latency_p99_s": round(percentile(lat, 99), 2) if lat else 0.0,
        "failed": n - len(bound),
    }


# What `run_one` may wrap the measured window in, given the pid of each process it runs (bench.profile
# samples the provisioner with py-spy there): entered once every process is ready, before the
# first claim is created, and left once the last one is Bound.
Observer = Callable[[Mapping[str, int]], AbstractAsyncContextManager[Any]]


async def run_one(scenario: str, side: str, n: int, observe: Observer | None = None) -> Run:
    qps, burst = SCENARIOS[scenario]
    logs = REPO_ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bp", dir="/tmp"))
    async with control_plane() as cp:
        api = await ApiClient.from_kubeconfig(str(cp.admin_kubeconfig), qps=0, burst=1)
        procs: list[asyncio.subprocess.Process] = []
        try:
            driver_http = f"127.0.0.1:{free_ports(1)[0]}"
            driver, socket = await start_controller_driver(
                root, logs / f"provisioning-{scenario}-{side}-driver.log", driver_http
            )
            procs.append(driver)
            binder, binder_mark = await start_binder(
                cp.admin_kubeconfig, logs / f"provisioning-{scenario}-{side}-pv-controller.log"
            )
            procs.append(binder)
            await api.create(NAMESPACES, {"metadata": {"name": NAMESPACE}})
            # The Go sidecar refuses to provision for a topology-aware driver until some node
            # reports the driver's topology; one node serves both sides.
            await api.create(
                NODES, {"metadata": {"name": "bench-node", "labels": {TOPOLOGY_KEY: "bench-node"}}}
            )
            await api.create(
                CSI_NODES,
                {
                    "metadata": {"name": "bench-node"},
                    "spec": {
                        "drivers": [
                            {"name": DRIVER_NAME, "nodeID": "bench-node", "topologyKeys": [TOPOLOGY_KEY]}
                        ]
                    },
                },
            )
            await api.create(
                STORAGE_CLASSES,
                {"metadata": {"name": CLASS}, "provisioner": DRIVER_NAME, "volumeBindingMode": "Immediate"},
            )
            prov_log = logs / f"provisioning-{scenario}-{side}.log"
            prov_mark = LogMark.here(prov_log)
            prov = await start(
                provisioner_argv(side, cp.admin_kubeconfig, socket, qps, burst, root / "provisioner"),
                prov_log,
            )
            procs.append(prov)
            settle = asyncio.create_task(asyncio.sleep(3))
            ready = await wait_log(prov_mark, READY[side], prov)
            await wait_log(binder_mark, READY["pv-controller"], binder)
            await settle

            created: dict[str, float] = {}
            bound: dict[str, float] = {}
            done = asyncio.Event()

            def seen(pvc: Obj) -> None:
                name = pvc["metadata"]["name"]
                if pvc.get("status", {}).get("phase") == "Bound" and name not in bound:
                    bound[name] = time.monotonic()
                    if len(bound) == n:
                        done.set()

            informer = SharedInformer(api, PERSISTENT_VOLUME_CLAIMS, namespace=NAMESPACE)
            informer.add_handler(EventHandler(seen, lambda _o, p: seen(p), None))
            informer.start()
            await informer.wait_for_sync()

            peak = 0
            sem = asyncio.Semaphore(64)

            async def create(i: int) -> None:
                name = f"c{i:04d}"
                body = {
                    "metadata": {"name": name},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "16Mi"}},
                        "storageClassName": CLASS,
                    },
                }
                async with sem:
                    created[name] = time.monotonic()
                    await api.create(PERSISTENT_VOLUME_CLAIMS, body, NAMESPACE)

            shared = {
                **{name: proc.pid for name, proc in cp.processes.items()},
                "driver": driver.pid,
                "pv-controller": binder.pid,
                "provisioner": prov.pid,
            }
            work = WorkCounts(cp, driver_http)
            await work.start()
            observed = observe({k: v for k, v in shared.items() if v is not None}) if observe else None
            async with observed or contextlib.nullcontext():
                with CpuUse(lambda: shared) as use:
                    t0 = time.monotonic()
                    await asyncio.gather(*(create(i) for i in range(n)))
                    deadline = t0 + 900
                    while not done.is_set() and time.monotonic() < deadline:
                        with contextlib.suppress(FileNotFoundError, RuntimeError):
                            assert prov.pid is not None
                            peak = max(peak, rss_bytes(prov.pid))
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(done.wait(), 0.5)
            total = (max(bound.values()) if bound else time.monotonic()) - t0
            await work.stop()
            cpu = cpu_seconds(prov.pid)
            await informer.stop()
            return Run(
                scenario=scenario,
                side=side,
                claims=n,
                qps=qps,
                burst=burst,
                workers=WORKERS,
                **claim_figures(n, total, created, bound),
                peak_rss_mib=round(peak / (1 << 20), 1),
                cpu_s=round(cpu, 1),
                ready_s=round(ready, 2),
                window_cpu_s=use.total(["provisioner"]),
                driver_cpu_s=use.total(["driver"]),
                binder_cpu_s=use.total(["pv-controller"]),
                server_cpu_s=use.total(cp.processes),
                **work.figures(n),
            )
        finally:
            for proc in reversed(procs):
                await stop_process(proc)
            await api.close()
            shutil.rmtree(root, ignore_errors=True)


BENCH = method.Bench(
    name="provisioning",
    title="N claims created at once on an Immediate class -> Bound",
    sides={"kubeloop": "kubeloop external-provisioner", "go": "Go external-provisioner"},
    figures=(
        *method.claims_figures("claims_per_s", "claims/s"),
        method.Figure("ready_s", "start-up s"),
        method.Figure("window_cpu_s", "CPU s while provisioning"),
        method.Figure("driver_cpu_s", "driver CPU s"),
        method.Figure("binder_cpu_s", "pv-controller CPU s"),
        method.Figure("server_cpu_s", "apiserver+etcd CPU s"),
        method.Figure("api_requests_per_op", "API requests per claim"),
        method.Figure("csi_calls_per_op", "CSI calls per claim"),
    ),
)


def main() -> None:
    go_binary()
    method.claims_main(BENCH, __doc__.split("\n\n")[0], SCENARIOS, CLAIMS_DEFAULT, run_one)


if __name__ == "__main__":
    main()
