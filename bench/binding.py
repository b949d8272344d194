"""bench/binding: static binding of pre-created PV/PVC pairs by kubeloop's pv-controller, side by
side with kube-controller-manager's persistentvolume-binder (the same cached kcm binary, run with
only `--controllers=persistentvolume-binder-controller`).

    python -m bench.binding [--pairs 50 | --large] [--rounds 5] [--scenarios default,unthrottled]
                            [--workers N] [--binds-in-flight N] [--output NAME] [--profile DIR]

Each (scenario, side) gets a fresh etcd + kube-apiserver and a fresh object set: N PersistentVolumes
and N claims that each fit any of them. Then the controller process starts (t0) and the bench
watches until every claim is Bound. Reported per run:

- total: t0 until the last claim is Bound, and the resulting binds per second;
- per-claim bind latency, two ways. "done p50/p99" counts from t0: the claims are pre-created
  and nothing can bind them before the controller starts, so this is how long each claim waited
  for its binding. "bind p50/p99" is the write sequence of one bind: from the moment its volume
  got the claimRef (the bind's first write) until the claim was Bound (its last write);
- writes/bind: the apiserver's own count of writes (UPDATE/PATCH/CREATE/DELETE of PVs, PVCs,
  events) during the run, divided by N; includes each volume's Pending -> Available write, which
  kcm makes too (it only binds Available volumes);
- peak RSS of the controller process;
- CPU seconds (user + system) of the controller, the apiserver and etcd during the run, from
  /proc: on a small machine they share the cores, so what the controller spends the apiserver
  does not get.

Both sides get the same fresh control plane (etcd without fsync + kube-apiserver), the same
objects, the same --kube-api-qps/--kube-api-burst, and the same resync period (kcm's default
15 s); t0 is the spawn of the controller process, so start-up (Python imports, Go init) counts.

Scenarios: `default` runs both at kcm's client defaults (QPS 20 / burst 30), `unthrottled` at
QPS 5000 / burst 10000. Within a scenario the rounds run kubeloop, then kcm (bench/method.py).
Prints a table and writes bench/results/binding.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller_runtime.client import ApiClient
from controller_runtime.resources import NAMESPACES, PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, Obj
from controller_runtime.toolchain import REPO_ROOT
from localstack.controlplane import ControlPlane
from localstack.proc import free_ports
from services.pv_controller.controller import Options

from . import method
from .common import control_plane, cpu_seconds, kcm_argv, percentile, rss_bytes, stop_process

NAMESPACE = "bench"
SCENARIOS = {"default": (20.0, 30), "unthrottled": (5000.0, 10000)}
# Small enough that `make bench` (5 rounds of each side, both scenarios) fits its 30 minutes on 2 cores.
PAIRS_DEFAULT = 50
# The apiserver labels requests with HTTP-style verbs (PUT, POST) in apiserver_request_total.
WRITE_VERBS = {"PUT", "PATCH", "POST", "DELETE", "UPDATE", "CREATE"}
WRITE_RESOURCES = {"persistentvolumes", "persistentvolumeclaims", "events"}


@dataclass
class Run:
    scenario: str
    side: str
    pairs: int
    qps: float
    burst: int
    total_s: float
    binds_per_s: float
    completion_p50_s: float
    completion_p99_s: float
    bind_latency_p50_ms: float
    bind_latency_p99_ms: float
    writes_per_bind: float
    peak_rss_mb: float
    timed_out: bool
    # CPU seconds (user + system) spent during the run by the controller, the apiserver and etcd:
    # on a CPU-bound machine whatever the controller spends is taken from the other two.
    controller_cpu_s: float = 0.0
    apiserver_cpu_s: float = 0.0
    etcd_cpu_s: float = 0.0


def pv(i: int) -> Obj:
    return {
        "metadata": {"name": f"bench-pv-{i:05d}"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": f"/tmp/kubeloop-bench/{i}"},
        },
    }


def pvc(i: int) -> Obj:
    return {
        "metadata": {"name": f"data-{i:05d}"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "",
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }


async def create_all(api: ApiClient, n: int) -> None:
    await api.create(NAMESPACES, {"metadata": {"name": NAMESPACE}})
    sem = asyncio.Semaphore(32)

    async def one(res: Any, obj: Obj, ns: str | None) -> None:
        async with sem:
            await api.create(res, obj, ns)

    await asyncio.gather(*(one(PERSISTENT_VOLUMES, pv(i), None) for i in range(n)))
    await asyncio.gather(*(one(PERSISTENT_VOLUME_CLAIMS, pvc(i), NAMESPACE) for i in range(n)))


async def write_count(api: ApiClient) -> int:
    """Writes the apiserver has served to PVs, PVCs and events, from its own metrics."""
    body = await api.get_text("/metrics")
    total = 0
    for line in body.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels_part, _, value = line.rpartition(" ")
        labels = dict(
            kv.split("=", 1)
            for kv in labels_part[len("apiserver_request_total{") : -1].split(",")
            if "=" in kv
        )
        verb = labels.get("verb", "").strip('"')
        resource = labels.get("resource", "").strip('"')
        if verb in WRITE_VERBS and resource in WRITE_RESOURCES:
            total += int(float(value))
    return total


class Observer:
    """Watches PVs and PVCs and timestamps, per claim, the first claimRef on its volume and the
    moment it became Bound."""

    def __init__(self, api: ApiClient, n: int) -> None:
        self.api = api
        self.n = n
        self.claimref_at: dict[str, float] = {}  # claim name -> first time a PV pointed at it
        self.bound_at: dict[str, float] = {}
        self.done = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        _, pv_rv = await self.api.list_all(PERSISTENT_VOLUMES, page_size=1)
        _, pvc_rv = await self.api.list_all(PERSISTENT_VOLUME_CLAIMS, NAMESPACE, page_size=1)
        self._tasks = [
            asyncio.create_task(self._watch(PERSISTENT_VOLUMES, None, pv_rv, self._on_pv)),
            asyncio.create_task(self._watch(PERSISTENT_VOLUME_CLAIMS, NAMESPACE, pvc_rv, self._on_pvc)),
        ]

    async def _watch(self, res: Any, ns: str | None, rv: str, fn: Any) -> None:
        while True:
            async for kind, obj in self.api.watch(res, ns, resource_version=rv, timeout_seconds=600):
                if kind == "BOOKMARK":
                    rv = obj["metadata"]["resourceVersion"]
                    continue
                rv = obj["metadata"]["resourceVersion"]
                fn(obj)

    def _on_pv(self, obj: Obj) -> None:
        ref = obj.get("spec", {}).get("claimRef")
        if ref and ref.get("name") not in self.claimref_at:
            self.claimref_at[ref["name"]] = time.monotonic()

    def _on_pvc(self, obj: Obj) -> None:
        name = obj["metadata"]["name"]
        if obj.get("status", {}).get("phase") == "Bound" and name not in self.bound_at:
            self.bound_at[name] = time.monotonic()
            if len(self.bound_at) >= self.n:
                self.done.set()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


def kubeloop_argv(cp: ControlPlane, qps: float, burst: int, workers: int, binds: int) -> list[str]:
    (port,) = free_ports(1)
    return [
        sys.executable,
        "-m",
        "services.pv_controller.main",
        f"--kubeconfig={cp.admin_kubeconfig}",
        f"--kube-api-qps={qps}",
        f"--kube-api-burst={burst}",
        f"--worker-threads={workers}",
        f"--binds-in-flight={binds}",
        f"--http-endpoint=127.0.0.1:{port}",
    ]


def kcm_side_argv(cp: ControlPlane, qps: float, burst: int, _workers: int, _binds: int) -> list[str]:
    (port,) = free_ports(1)
    return kcm_argv("persistentvolume-binder-controller", str(cp.admin_kubeconfig), qps, burst, port)


SIDES = {"kubeloop": kubeloop_argv, "go": kcm_side_argv}


async def run_one(
    scenario: str,
    side: str,
    n: int,
    workers: int,
    timeout: float,
    logs: Path,
    binds: int = Options.binds_in_flight,
    profile: Path | None = None,
    logs_prefix: str = "binding",
) -> Run:
    qps, burst = SCENARIOS[scenario]
    async with control_plane() as cp:
        api = await ApiClient.from_kubeconfig(str(cp.admin_kubeconfig), qps=0, burst=1, user_agent="bench")
        try:
            await create_all(api, n)
            observer = Observer(api, n)
            await observer.start()
            before = await write_count(api)
            log = logs / f"{logs_prefix}-{scenario}-{side}.log"
            server_pids = {name: cp.processes[name].pid for name in ("kube-apiserver", "etcd")}
            server_cpu = {name: cpu_seconds(pid) for name, pid in server_pids.items()}
            t0 = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *SIDES[side](cp, qps, burst, workers, binds),
                cwd=REPO_ROOT,
                stdout=log.open("wb"),
                stderr=asyncio.subprocess.STDOUT,
            )
            peak = 0
            controller_cpu = 0.0
            profiler = None
            if profile is not None and side == "kubeloop":
                profiler = await asyncio.create_subprocess_exec(
                    str(Path(sys.executable).with_name("py-spy")),
                    "record",
                    "--pid",
                    str(proc.pid),
                    "--rate",
                    "200",
                    "--format",
                    "speedscope" if profile.suffix == ".json" else "flamegraph",
                    "--output",
                    str(profile),
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )

            async def sample_rss() -> None:
                nonlocal peak, controller_cpu
                while True:
                    with contextlib.suppress(Exception):
                        peak = max(peak, rss_bytes(proc.pid))
                        controller_cpu = cpu_seconds(proc.pid) or controller_cpu
                    await asyncio.sleep(0.25)

            sampler = asyncio.create_task(sample_rss())
            timed_out = False
            try:
                await asyncio.wait_for(observer.done.wait(), timeout)
            except TimeoutError:
                timed_out = True
            finished = time.monotonic()
            sampler.cancel()
            controller_cpu = cpu_seconds(proc.pid) or controller_cpu
            server_cpu = {name: cpu_seconds(pid) - server_cpu[name] for name, pid in server_pids.items()}
            if profiler is not None:
                profiler.send_signal(signal.SIGINT)
                await profiler.wait()
            await stop_process(proc)
            after = await write_count(api)
            await observer.stop()
        finally:
            await api.close()
    bound = observer.bound_at
    completion = [t - t0 for t in bound.values()] or [float("nan")]
    latency = [
        (bound[name] - observer.claimref_at[name]) * 1000 for name in bound if name in observer.claimref_at
    ] or [float("nan")]
    total = (max(bound.values()) if bound else finished) - t0
    return Run(
        scenario=scenario,
        side=side,
        pairs=n,
        qps=qps,
        burst=burst,
        total_s=round(total, 2),
        binds_per_s=round(len(bound) / total, 1) if total > 0 else 0.0,
        completion_p50_s=round(percentile(completion, 50), 2),
        completion_p99_s=round(percentile(completion, 99), 2),
        bind_latency_p50_ms=round(percentile(latency, 50), 1),
        bind_latency_p99_ms=round(percentile(latency, 99), 1),
        writes_per_bind=round((after - before) / max(1, len(bound)), 2),
        peak_rss_mb=round(peak / 2**20, 1),
        timed_out=timed_out,
        controller_cpu_s=round(controller_cpu, 1),
        apiserver_cpu_s=round(server_cpu["kube-apiserver"], 1),
        etcd_cpu_s=round(server_cpu["etcd"], 1),
    )


FIGURES = (
    method.Figure("total_s", "total s"),
    method.Figure("binds_per_s", "binds/s", "higher"),
    method.Figure("completion_p50_s", "done p50 s"),
    method.Figure("completion_p99_s", "done p99 s"),
    method.Figure("bind_latency_p50_ms", "bind p50 ms"),
    method.Figure("bind_latency_p99_ms", "bind p99 ms"),
    method.Figure("writes_per_bind", "writes/bind"),
    method.Figure("peak_rss_mb", "peak RSS MB"),
    method.Figure("controller_cpu_s", "controller CPU s"),
    method.Figure("apiserver_cpu_s", "apiserver CPU s"),
)


async def collect(args: argparse.Namespace) -> dict[str, list[method.Pair]]:
    n = 5000 if args.large else args.pairs
    logs = REPO_ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    async def one(scenario: str, side: str, r: int) -> Run:
        qps, _ = SCENARIOS[scenario]
        # Five writes per pair at the client limit, plus a resync and process start-up.
        timeout = 5 * n / qps * 2 + 120
        # The profile, if asked for, of the first round's kubeloop run of each scenario.
        profile = Path(args.profile) / f"binding-{scenario}.svg" if args.profile and r == 0 else None
        return await run_one(
            scenario, side, n, args.workers, timeout, logs, args.binds_in_flight, profile, args.output
        )

    return await method.alternate_scenarios(method.qps_labels(args.scenarios, SCENARIOS), args.rounds, one)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--pairs", type=int, default=PAIRS_DEFAULT, help=f"PV/PVC pairs per run (default: {PAIRS_DEFAULT})"
    )
    parser.add_argument("--large", action="store_true", help="5000 pairs")
    parser.add_argument(
        "--scenarios", default="default,unthrottled", help="comma-separated: default,unthrottled"
    )
    method.add_rounds_arg(parser)
    parser.add_argument(
        "--workers", type=int, default=Options.workers, help="kubeloop --worker-threads (default: its own)"
    )
    parser.add_argument(
        "--binds-in-flight",
        type=int,
        default=Options.binds_in_flight,
        help="kubeloop --binds-in-flight (default: its own)",
    )
    parser.add_argument("--output", default="binding", help="results name: bench/results/NAME.json")
    parser.add_argument(
        "--profile",
        default="",
        help="directory: record the kubeloop side with py-spy (flame graph per scenario)",
    )
    args = parser.parse_args()
    bench = method.Bench(
        name=args.output,
        title="static binding of pre-created PV/PVC pairs",
        sides={"kubeloop": "kubeloop pv-controller", "go": "kcm persistentvolume-binder"},
        figures=FIGURES,
    )
    params = {
        "pairs": 5000 if args.large else args.pairs,
        "workers": args.workers,
        "binds in flight": args.binds_in_flight,
    }
    method.run(bench, params, lambda: collect(args))


if __name__ == "__main__":
    main()
