"""bench/node_provisioning: distributed provisioning of node-local volumes. N WaitForFirstConsumer
claims, each used by a pod, are created at once on a cluster of three nodes; the real kube-scheduler
spreads the pods over the nodes and picks each claim's node by the CSIStorageCapacity objects; on
every node an external-provisioner in node deployment (`--node-deployment --strict-topology
--immediate-topology=false --enable-capacity`) provisions the claims selected for its node through
that node's kubeloop CSI driver (`--mode all --node-local`, its own pool). kubeloop's provisioner
side by side with the Go kubernetes-csi external-provisioner (v6.3.x, built by
`tools/build-binaries.sh external-provisioner`), over the same drivers.

    python -m bench.node_provisioning [--claims 300] [--rounds 3] [--scenarios default,unthrottled]

Each (scenario, side) gets a fresh etcd, kube-apiserver and kube-scheduler, three fresh drivers and
kubeloop's pv-controller (generous QPS, 16 binds in flight: it completes the binds for both sides and
must not be the bottleneck). The three Node objects are registered with room for every pod and no
kubelet runs: a pod is done once the scheduler has bound it, which it does only after its claim is
Bound. The provisioners start, publish their node's capacity (the scheduler finds no node for a
claim before that), then the N claim + pod pairs are created (t0) and the bench watches until every
claim is Bound. Both sides run with the same --kube-api-qps/-burst and --worker-threads; `default`
is the sidecar's defaults (QPS 5 / burst 10, 100 workers), `unthrottled` QPS 1000 / burst 2000.

Reported: total time and claims per second, per-claim latency (created -> Bound) p50/p99, failed
claims, the three provisioners' summed CPU and largest peak RSS, the spread of claims over the
nodes, and the CPU of what both sides share (drivers, pv-controller, scheduler, apiserver + etcd).
Within a scenario the rounds run kubeloop, then Go (bench/method.py). Writes
bench/results/node_provisioning.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller_runtime.client import ApiClient
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.resources import (
    CSI_DRIVERS,
    CSI_NODES,
    CSI_STORAGE_CAPACITIES,
    NAMESPACES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PODS,
    SERVICE_ACCOUNTS,
    STORAGE_CLASSES,
    Obj,
)
from controller_runtime.toolchain import REPO_ROOT
from csi_driver import DRIVER_NAME, TOPOLOGY_KEY

from . import method
from .common import (
    CpuUse,
    LogMark,
    PeakRss,
    control_plane,
    cpu_seconds,
    start,
    stop_process,
    wait_log,
    wait_socket,
)
from .provisioning import READY, SCENARIOS, WORKERS, claim_figures, go_binary, start_binder

NAMESPACE = "bench"
CLASS = "bench-wffc"
NODE_NAMES = ("bench-a", "bench-b", "bench-c")
CLAIMS_DEFAULT = 300
# The annotation kube-scheduler writes on a WaitForFirstConsumer claim: the node it chose.
SELECTED_NODE = "volume.kubernetes.io/selected-node"


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
    peak_rss_mib: float  # the largest of the three provisioners
    cpu_s: float  # the three provisioners' user+system CPU over the whole run
    window_cpu_s: float = math.nan  # theirs from t0 to the last claim Bound
    driver_cpu_s: float = math.nan  # the three drivers', same window
    binder_cpu_s: float = math.nan
    server_cpu_s: float = math.nan  # etcd, kube-apiserver and kube-scheduler
    per_node: dict[str, int] = field(default_factory=dict)


def node_object(name: str) -> Obj:
    """A Node as a kubelet registers it: Ready, room for every pod, labelled with its hostname and
    with the driver's topology segment (kubelet adds that label when the node plugin registers)."""
    room = {"cpu": "64", "memory": "256Gi", "pods": "5000"}
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, TOPOLOGY_KEY: name}},
        "status": {
            "capacity": room,
            "allocatable": room,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
        },
    }


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
        # hostpath's distributed deployment; no pod owns the capacity objects here.
        "--node-deployment=true",
        "--strict-topology=true",
        "--immediate-topology=false",
        "--enable-capacity=true",
        "--capacity-ownerref-level=-1",
        "--capacity-poll-interval=10s",
    ]
    if side == "go":
        return [str(go_binary()), *common, "--v=1"]
    return [sys.executable, "-m", "external_provisioner.main", *common, f"--state-dir={state}", "-v=1"]


async def start_node_driver(root: Path, node: str, log: Path) -> tuple[asyncio.subprocess.Process, Path]:
    """A node's kubeloop CSI driver in node-local mode, its pool and state under root/<node>."""
    home = root / node
    socket = home / "csi.sock"
    argv = [
        sys.executable,
        "-m",
        "csi_driver.main",
        "--mode=all",
        "--node-local",
        f"--node-id={node}",
        f"--endpoint=unix://{socket}",
        f"--pool-dir={home / 'pool'}",
        f"--state-dir={home / 'state'}",
        f"--kubelet-dir={home / 'kubelet'}",
        "--capacity=10Ti",
        "-v=1",
    ]
    # Node-local mode wants the pool made by whoever provides the disk (a missing one is an error).
    (home / "pool").mkdir(parents=True)
    driver = await start(argv, log)
    await wait_socket(socket, driver)
    return driver, socket


async def wait_capacity(api: ApiClient, nodes: int, timeout: float = 120) -> None:
    """Until every node's provisioner has published its capacity for the class: before that the
    scheduler finds no node with room, and a pod would wait out its backoff instead of being timed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = await api.list_page(CSI_STORAGE_CAPACITIES, NAMESPACE)
        ready = [
            c for c in listed.get("items", []) if c.get("storageClassName") == CLASS and c.get("capacity")
        ]
        if len(ready) >= nodes:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(
        f"the provisioners published no capacity for {CLASS} on {nodes} nodes in {timeout:g} s"
    )


async def report_unscheduled(api: ApiClient) -> None:
    """Why claims never bound: the scheduler's condition on a few of their pods."""
    listed = await api.list_page(PODS, NAMESPACE)
    for pod in listed.get("items", [])[:3]:
        for cond in pod.get("status", {}).get("conditions", []):
            name, reason = pod["metadata"]["name"], cond.get("reason", "")
            print(f"  pod {name}: {cond.get('type')} {reason} {cond.get('message', '')}")


async def create_driver_and_class(api: ApiClient, allow_expansion: bool = False) -> None:
    """The CSIDriver as the chart installs it in node-local mode, and the WaitForFirstConsumer class
    CLASS of it (allowing expansion when asked)."""
    await api.create(
        CSI_DRIVERS,
        {
            "metadata": {"name": DRIVER_NAME},
            "spec": {"attachRequired": False, "storageCapacity": True, "podInfoOnMount": False},
        },
    )
    storage_class: dict[str, Any] = {
        "metadata": {"name": CLASS},
        "provisioner": DRIVER_NAME,
        "volumeBindingMode": "WaitForFirstConsumer",
    }
    if allow_expansion:
        storage_class["allowVolumeExpansion"] = True
    await api.create(STORAGE_CLASSES, storage_class)


async def run_one(scenario: str, side: str, n: int) -> Run:
    qps, burst = SCENARIOS[scenario]
    logs = REPO_ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bnp", dir="/tmp"))
    async with control_plane(with_scheduler=True) as cp:
        api = await ApiClient.from_kubeconfig(str(cp.admin_kubeconfig), qps=0, burst=1)
        procs: list[asyncio.subprocess.Process] = []
        try:
            await api.create(NAMESPACES, {"metadata": {"name": NAMESPACE}})
            # No kube-controller-manager makes the namespace's default ServiceAccount, which
            # admission wants before it takes a pod.
            await api.create(SERVICE_ACCOUNTS, {"metadata": {"name": "default"}}, NAMESPACE)
            await create_driver_and_class(api)
            drivers: dict[str, asyncio.subprocess.Process] = {}
            sockets: dict[str, Path] = {}
            for node in NODE_NAMES:
                await api.create(NODES, node_object(node))
                await api.create(
                    CSI_NODES,
                    {
                        "metadata": {"name": node},
                        "spec": {
                            "drivers": [{"name": DRIVER_NAME, "nodeID": node, "topologyKeys": [TOPOLOGY_KEY]}]
                        },
                    },
                )
                drivers[node], sockets[node] = await start_node_driver(
                    root, node, logs / f"node-provisioning-{scenario}-{side}-driver-{node}.log"
                )
                procs.append(drivers[node])
            binder, binder_mark = await start_binder(
                cp.admin_kubeconfig, logs / f"node-provisioning-{scenario}-{side}-pv-controller.log"
            )
            procs.append(binder)
            provs: dict[str, asyncio.subprocess.Process] = {}
            marks = {}
            for node in NODE_NAMES:
                log = logs / f"node-provisioning-{scenario}-{side}-{node}.log"
                marks[node] = LogMark.here(log)
                argv = provisioner_argv(
                    side, cp.admin_kubeconfig, sockets[node], qps, burst, root / node / "prov"
                )
                env = {**os.environ, "NODE_NAME": node, "NAMESPACE": NAMESPACE}
                provs[node] = await start(argv, log, env=env)
                procs.append(provs[node])
            for node in NODE_NAMES:
                await wait_log(marks[node], READY[side], provs[node])
            await wait_log(binder_mark, READY["pv-controller"], binder)
            await wait_capacity(api, len(NODE_NAMES))

            created: dict[str, float] = {}
            bound: dict[str, float] = {}
            node_of: dict[str, str] = {}
            done = asyncio.Event()

            def seen(pvc: Obj) -> None:
                name = pvc["metadata"]["name"]
                if pvc.get("status", {}).get("phase") == "Bound" and name not in bound:
                    bound[name] = time.monotonic()
                    node_of[name] = pvc["metadata"].get("annotations", {}).get(SELECTED_NODE, "")
                    if len(bound) == n:
                        done.set()

            informer = SharedInformer(api, PERSISTENT_VOLUME_CLAIMS, namespace=NAMESPACE)
            informer.add_handler(EventHandler(seen, lambda _o, p: seen(p), None))
            informer.start()
            await informer.wait_for_sync()
            sem = asyncio.Semaphore(64)

            async def create(i: int) -> None:
                name = f"c{i:04d}"
                claim = {
                    "metadata": {"name": name},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "16Mi"}},
                        "storageClassName": CLASS,
                    },
                }
                pod = {
                    "metadata": {"name": name, "labels": {"app": "bench"}},
                    "spec": {
                        "containers": [{"name": "c", "image": "kubeloop/busybox:1.35.0"}],
                        # Admission taints a new Node not-ready until kcm's node lifecycle
                        # controller sees it Ready; no kcm runs here.
                        "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}],
                        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": name}}],
                    },
                }
                async with sem:
                    created[name] = time.monotonic()
                    await api.create(PERSISTENT_VOLUME_CLAIMS, claim, NAMESPACE)
                    await api.create(PODS, pod, NAMESPACE)

            shared = {
                **{name: proc.pid for name, proc in cp.processes.items()},
                **{f"driver-{node}": p.pid for node, p in drivers.items()},
                "pv-controller": binder.pid,
                **{f"provisioner-{node}": p.pid for node, p in provs.items()},
            }
            async with PeakRss(lambda: {node: p.pid for node, p in provs.items()}) as peaks:
                with CpuUse(lambda: shared) as use:
                    t0 = time.monotonic()
                    await asyncio.gather(*(create(i) for i in range(n)))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(done.wait(), float(os.environ.get("BENCH_TIMEOUT", "900")))
            total = (max(bound.values()) if bound else time.monotonic()) - t0
            if len(bound) < n:
                await report_unscheduled(api)
            cpu = sum(cpu_seconds(p.pid) for p in provs.values())
            await informer.stop()
            return Run(
                scenario=scenario,
                side=side,
                claims=n,
                qps=qps,
                burst=burst,
                workers=WORKERS,
                **claim_figures(n, total, created, bound),
                peak_rss_mib=max(peaks.peaks.values(), default=0.0),
                cpu_s=round(cpu, 1),
                window_cpu_s=use.total(f"provisioner-{node}" for node in NODE_NAMES),
                driver_cpu_s=use.total(f"driver-{node}" for node in NODE_NAMES),
                binder_cpu_s=use.total(["pv-controller"]),
                server_cpu_s=use.total(cp.processes),
                per_node={node: sum(1 for v in node_of.values() if v == node) for node in NODE_NAMES},
            )
        finally:
            for proc in reversed(procs):
                await stop_process(proc)
            await api.close()
            shutil.rmtree(root, ignore_errors=True)


BENCH = method.Bench(
    name="node_provisioning",
    title="N WaitForFirstConsumer claims with pods on three nodes, node-deployment provisioners -> Bound",
    sides={"kubeloop": "kubeloop external-provisioner x3", "go": "Go external-provisioner x3"},
    figures=(
        *method.claims_figures("claims_per_s", "claims/s"),
        method.Figure("window_cpu_s", "CPU s while provisioning"),
        method.Figure("driver_cpu_s", "drivers CPU s"),
        method.Figure("binder_cpu_s", "pv-controller CPU s"),
        method.Figure("server_cpu_s", "apiserver+etcd+scheduler CPU s"),
    ),
)


def main() -> None:
    go_binary()
    method.claims_main(BENCH, __doc__.split("\n\n")[0], SCENARIOS, CLAIMS_DEFAULT, run_one)


if __name__ == "__main__":
    main()
