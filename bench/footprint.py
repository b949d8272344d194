"""bench/footprint: what kubeloop's processes hold in memory, at idle and under load, side by side
with the Go kubernetes-csi sidecars doing the same job, and how long each takes to start (issue 49).

    python -m bench.footprint [--claims 50] [--pods 20] [--rounds 3] [--scenarios node,attach]
    python -m bench.footprint --scenarios kind [--claims 20] [--no-build]

`node`: the node DaemonSet pod of the Helm chart's node-local mode, its processes run locally with
the chart's arguments (deploy/helm/kubeloop/templates/node-local.yaml; paths under a temporary
directory, the admin kubeconfig instead of in-cluster credentials, no capacity owner): the CSI
driver (`--mode=all --node-local`), the external-provisioner and external-resizer in node
deployment, node-driver-registrar, livenessprobe and upstream's csi-snapshotter (Go on both
sides: kubeloop has no snapshotter). The Go side runs the same pod with csi-provisioner,
csi-resizer, csi-node-driver-registrar and livenessprobe, each where it is built (the first two by
`tools/build-binaries.sh`, the other two from their release tags: see docs/benchmarks.md); a
process that is not built is left out of its side and its figures are NaN. Per round and side, on
a fresh etcd + kube-apiserver with kubeloop's pv-controller (unmeasured) binding:

1. start-up: each process from its start to its ready line (the driver: its socket);
2. idle: RSS and PSS (/proc/PID/smaps_rollup: pages shared between the processes, the
   interpreter's and libraries' file pages above all, are counted once in the sum) of every
   process, 10 s after the last one was ready;
3. load: N WaitForFirstConsumer claims created at once, already carrying the node the scheduler
   would pick (no scheduler runs), provisioned by the pod's provisioner and bound, then every
   claim's request raised (16 to 32 MiB) and the PVs resized by the pod's resizer; peak RSS of
   every process over both, and RSS and PSS 5 s after the last resize.

The pod's sums (RSS, PSS) are those of the six processes; `floor` is an interpreter that only
imports grpc.aio and serves one unix socket, what any Python gRPC sidecar costs at least (run on
the kubeloop side only).

`attach`: bench.attach's stack (one control plane, the shared node side, N pre-bound volumes
formatted once), its kubeloop side (external-attacher and attach-detach controller) against its
Go side (csi-attacher and kube-controller-manager with only its attach-detach controller): each
side's two processes' RSS and PSS at idle (10 s after an unmeasured pass of one pod, which
bench.attach's passes start with), their peak RSS over one pass of N pods attached, mounted,
unmounted and detached, and their RSS 5 s after it. Needs root.

Rounds alternate kubeloop and Go (bench/method.py). Writes bench/results/footprint.json (`node`)
and bench/results/footprint_attach.json (`attach`).

`kind` (only when named; bench/footprint_kind.py): the same node pod as kubelet runs it, in the
cluster of `make kind-up KIND_POOLS=separate`, per container RSS, PSS and the memory cgroup's
working set, idle and around a load of N claims mounted by pods on one worker (default 20); one
round, kubeloop only. Writes bench/results/footprint_kind.json.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller_runtime.client import ApiClient
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.resources import (
    CSI_NODES,
    NAMESPACES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    Obj,
)
from controller_runtime.toolchain import REPO_ROOT, MissingBinaryError, Toolchain
from csi_driver import DRIVER_NAME, TOPOLOGY_KEY
from localstack.components import Component
from localstack.go_sidecars import PROVISIONER, RESIZER, GoSidecar, go_sidecar_binary
from localstack.snapshotter import snapshot_crds, snapshotter_binary
from localstack.storage_stack import ShortHomeComponents

from . import method, node_provisioning
from .common import LogMark, PeakRss, control_plane, start, stop_process, wait_log, wait_socket
from .node_provisioning import create_driver_and_class
from .provisioning import start_binder

MIB = 2**20
NAMESPACE = "bench"
CLASS = node_provisioning.CLASS
NODE = "bench-node"
SELECTED_NODE = "volume.kubernetes.io/selected-node"
FROM, TO = "16Mi", "32Mi"
IDLE_SETTLE_S = 10.0  # after the last process is ready, before the idle reading
AFTER_SETTLE_S = 5.0  # after the load, before the reading after it
CLAIMS_DEFAULT = 50
KIND_CLAIMS_DEFAULT = 20
PODS_DEFAULT = 20

# The node pod's processes, in the chart's container order.
POD = ("driver", "provisioner", "resizer", "registrar", "livenessprobe", "csi-snapshotter")
# Upstream's node sidecars, built from their release tags (the Go module proxy serves neither);
# they talk to no apiserver, so no ServiceAccount.
REGISTRAR = GoSidecar(
    "node-driver-registrar", "csi-node-driver-registrar", "NODE_DRIVER_REGISTRAR_VERSION", ""
)
LIVENESSPROBE = GoSidecar("livenessprobe", "livenessprobe", "LIVENESSPROBE_VERSION", "")
GO_SIDECARS = {
    "provisioner": PROVISIONER,
    "resizer": RESIZER,
    "registrar": REGISTRAR,
    "livenessprobe": LIVENESSPROBE,
}
# What each process logs once it is ready: its caches synced and workers started, the driver
# answered, the registration socket served.
READY = {
    ("kubeloop", "provisioner"): "caches synced, starting workers",
    ("go", "provisioner"): "Started provisioner controller",
    ("kubeloop", "resizer"): "caches synced, starting workers",
    ("go", "resizer"): "Starting external resizer",
    ("kubeloop", "registrar"): "registration socket ready for kubelet",
    ("go", "registrar"): "Registration Server started",
    ("kubeloop", "livenessprobe"): "CSI driver answered",
    ("go", "livenessprobe"): "ServeMux listening",
    ("kubeloop", "csi-snapshotter"): "Starting CSI snapshotter",
    ("go", "csi-snapshotter"): "Starting CSI snapshotter",
}
# The grpc floor: an interpreter that imports grpc.aio and serves one unix socket, nothing else.
FLOOR = """
import asyncio, sys
import grpc

async def main():
    server = grpc.aio.server()
    server.add_insecure_port("unix:" + sys.argv[1])
    await server.start()
    print("serving", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def smaps_rollup_mib(text: str) -> tuple[float, float]:
    """RSS and PSS (MiB) from the text of a /proc/PID/smaps_rollup."""
    fields = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()[1:] if ":" in line}
    return round(fields["Rss"] / 1024, 1), round(fields["Pss"] / 1024, 1)


def memory_mib(pid: int | None) -> tuple[float, float]:
    """RSS and PSS of a live process (MiB), from /proc/PID/smaps_rollup; NaN when it is gone."""
    if pid is None:
        return math.nan, math.nan
    try:
        return smaps_rollup_mib(Path(f"/proc/{pid}/smaps_rollup").read_text())
    except OSError:
        return math.nan, math.nan


def go_binary(sidecar: GoSidecar) -> Path | None:
    """The cached Go binary; None for the registrar and livenessprobe when they are not built (the
    load needs no node sidecar), an exit naming the build for the others."""
    try:
        return go_sidecar_binary(sidecar)
    except MissingBinaryError as exc:
        if sidecar in (REGISTRAR, LIVENESSPROBE):
            return None
        raise SystemExit(str(exc)) from None


def snapshotter() -> Path | None:
    try:
        return snapshotter_binary("csi-snapshotter")
    except MissingBinaryError:
        return None


@dataclass(frozen=True)
class Paths:
    root: Path
    kubeconfig: Path

    @property
    def socket(self) -> Path:
        return self.root / "csi" / "csi.sock"


def pod_argv(side: str, name: str, p: Paths) -> list[str] | None:
    """A node pod process's command line as the chart gives it; None when this side has no such
    process built."""
    csi = f"--csi-address={p.socket}"
    kube = f"--kubeconfig={p.kubeconfig}"
    py = [sys.executable, "-m"]
    if name == "driver":
        return [
            *py,
            "csi_driver.main",
            "--mode=all",
            "--node-local",
            f"--endpoint=unix://{p.socket}",
            f"--node-id={NODE}",
            f"--pool-dir={p.root / 'pool'}",
            f"--state-dir={p.root / 'state'}",
            f"--kubelet-dir={p.root / 'kubelet'}",
            "--capacity=10Ti",
            "--http-endpoint=127.0.0.1:0",
            "--v=2",
        ]
    if name == "csi-snapshotter":
        binary = snapshotter()
        if binary is None:
            return None
        return [str(binary), csi, kube, "--node-deployment", "--http-endpoint=127.0.0.1:0", "--v=2"]
    go = None
    if side == "go":
        go = go_binary(GO_SIDECARS[name])
        if go is None:
            return None
    if name == "provisioner":
        args = [
            csi,
            kube,
            "--extra-create-metadata",
            "--node-deployment",
            "--strict-topology",
            "--immediate-topology=false",
            "--enable-capacity",
            "--capacity-ownerref-level=-1",  # no pod here to own the capacity objects
            "--capacity-for-immediate-binding",
            "--http-endpoint=127.0.0.1:0",
            "--v=2",
        ]
        if go is not None:
            return [str(go), *args]
        return [*py, "external_provisioner.main", *args, f"--state-dir={p.root / 'provisioner'}"]
    if name == "resizer":
        args = [csi, kube, "--http-endpoint=127.0.0.1:0", "--v=2"]
        # csi-resizer has no node deployment (kubeloop's --node-deployment is its own flag): on the
        # Go side it resizes every PV, which with one node is the same job.
        return (
            [str(go), *args] if go is not None else [*py, "external_resizer.main", *args, "--node-deployment"]
        )
    if name == "registrar":
        args = [
            csi,
            f"--kubelet-registration-path={p.root / 'kubelet' / 'plugins' / DRIVER_NAME / 'csi.sock'}",
            f"--plugin-registration-path={p.root / 'registration'}",
            "--http-endpoint=127.0.0.1:0",
            "--v=2",
        ]
        return [str(go), *args] if go is not None else [*py, "node_driver_registrar.main", *args]
    if name == "livenessprobe":
        # The chart's :9808 is every interface; a free loopback port here.
        args = [csi, f"--http-endpoint=127.0.0.1:{free_port()}"]
        return [str(go), *args] if go is not None else [*py, "livenessprobe.main", *args]
    raise ValueError(name)


def free_port() -> int:
    from localstack.proc import free_ports

    return free_ports(1)[0]


async def node_objects(api: ApiClient) -> None:
    """The namespace, the CSIDriver as the chart installs it in node-local mode, a
    WaitForFirstConsumer class that allows expansion, and the Node with its CSINode."""
    await api.create(NAMESPACES, {"metadata": {"name": NAMESPACE}})
    await create_driver_and_class(api, allow_expansion=True)
    await api.create(
        NODES,
        {"metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE, TOPOLOGY_KEY: NODE}}},
    )
    await api.create(
        CSI_NODES,
        {
            "metadata": {"name": NODE},
            "spec": {"drivers": [{"name": DRIVER_NAME, "nodeID": NODE, "topologyKeys": [TOPOLOGY_KEY]}]},
        },
    )


async def apply_snapshot_crds(kubeconfig: Path) -> None:
    files = [f"--filename={path}" for path in snapshot_crds()]
    kubectl = [str(Toolchain.default().binary("kubectl")), f"--kubeconfig={kubeconfig}"]
    for args in (["apply", "--server-side", *files], ["wait", "--for=condition=established", *files]):
        done = await asyncio.to_thread(subprocess.run, [*kubectl, *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"kubectl {args[0]} of the snapshot CRDs failed: {done.stderr}")


class Claims:
    """Watches the bench's claims and PVs: which claims are Bound, which PVs have been resized."""

    def __init__(self, api: ApiClient, n: int) -> None:
        self.api, self.n = api, n
        self.bound: set[str] = set()
        self.resized: set[str] = set()
        self.all_bound, self.all_resized = asyncio.Event(), asyncio.Event()
        self.claims = SharedInformer(api, PERSISTENT_VOLUME_CLAIMS, namespace=NAMESPACE)
        self.pvs = SharedInformer(api, PERSISTENT_VOLUMES)
        self.claims.add_handler(EventHandler(self._claim, lambda _o, c: self._claim(c), None))
        self.pvs.add_handler(EventHandler(self._pv, lambda _o, v: self._pv(v), None))

    def _claim(self, claim: Obj) -> None:
        if claim.get("status", {}).get("phase") == "Bound":
            self.bound.add(claim["metadata"]["name"])
            if len(self.bound) >= self.n:
                self.all_bound.set()

    def _pv(self, pv: Obj) -> None:
        if pv.get("spec", {}).get("capacity", {}).get("storage") == TO:
            self.resized.add(pv["metadata"]["name"])
            if len(self.resized) >= self.n:
                self.all_resized.set()

    async def __aenter__(self) -> Claims:
        for informer in (self.claims, self.pvs):
            informer.start()
        await asyncio.gather(self.claims.wait_for_sync(), self.pvs.wait_for_sync())
        return self

    async def __aexit__(self, *_exc: object) -> None:
        for informer in (self.claims, self.pvs):
            await informer.stop()

    async def create(self) -> None:
        sem = asyncio.Semaphore(32)

        async def one(i: int) -> None:
            body = {
                "metadata": {"name": f"c{i:04d}", "annotations": {SELECTED_NODE: NODE}},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": FROM}},
                    "storageClassName": CLASS,
                },
            }
            async with sem:
                await self.api.create(PERSISTENT_VOLUME_CLAIMS, body, NAMESPACE)

        await asyncio.gather(*(one(i) for i in range(self.n)))

    async def resize(self) -> None:
        sem = asyncio.Semaphore(32)

        async def one(name: str) -> None:
            patch = {"spec": {"resources": {"requests": {"storage": TO}}}}
            async with sem:
                await self.api.patch(PERSISTENT_VOLUME_CLAIMS, name, patch, NAMESPACE)

        await asyncio.gather(*(one(name) for name in sorted(self.bound)))


def readings(prefix: str, pids: Mapping[str, int | None], names: tuple[str, ...]) -> dict[str, float]:
    """`<name>_<prefix>_rss_mib` and `_pss_mib` of each named process, and the sums over those
    that run (`pod_...`), NaN for a process its side does not run."""
    out: dict[str, float] = {}
    rss_sum = pss_sum = 0.0
    for name in names:
        rss, pss = memory_mib(pids.get(name))
        out[f"{name}_{prefix}_rss_mib"], out[f"{name}_{prefix}_pss_mib"] = rss, pss
        if not math.isnan(rss):
            rss_sum, pss_sum = rss_sum + rss, pss_sum + pss
    out[f"pod_{prefix}_rss_mib"], out[f"pod_{prefix}_pss_mib"] = round(rss_sum, 1), round(pss_sum, 1)
    return out


async def node_pod(side: str, n: int, timeout: float) -> dict[str, float]:
    """One side's node pod: start-up, idle, load (see the module doc)."""
    logs = REPO_ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bf", dir="/tmp"))
    for d in ("csi", "pool", "registration", "kubelet"):
        (root / d).mkdir()
    procs: dict[str, asyncio.subprocess.Process] = {}  # the measured ones
    helpers: list[asyncio.subprocess.Process] = []
    record: dict[str, float] = {}
    async with control_plane() as cp:
        api = await ApiClient.from_kubeconfig(str(cp.admin_kubeconfig), qps=0, burst=1, user_agent="bench")
        paths = Paths(root, cp.admin_kubeconfig)
        env = {**os.environ, "NODE_NAME": NODE, "KUBE_NODE_NAME": NODE, "NAMESPACE": NAMESPACE}
        try:
            await node_objects(api)
            if snapshotter() is not None:
                await apply_snapshot_crds(cp.admin_kubeconfig)
            binder, binder_mark = await start_binder(
                cp.admin_kubeconfig, logs / f"footprint-{side}-pv-controller.log"
            )
            helpers.append(binder)
            await wait_log(binder_mark, "first pass over volumes done", binder)

            async def launch(name: str) -> None:
                argv = pod_argv(side, name, paths)
                if argv is None:
                    record[f"{name}_start_s"] = math.nan
                    return
                log = logs / f"footprint-{side}-{name}.log"
                mark = LogMark.here(log)
                started = time.monotonic()
                procs[name] = proc = await start(argv, log, env=env)
                if name == "driver":
                    await wait_socket(paths.socket, proc)
                else:
                    await wait_log(mark, READY[side, name], proc)
                record[f"{name}_start_s"] = round(time.monotonic() - started, 2)

            # The driver first, as kubelet's restarts would settle it: every sidecar waits for its
            # socket, and its own start-up is not theirs.
            await launch("driver")
            await asyncio.gather(*(launch(name) for name in POD[1:]))
            if side == "kubeloop":
                log = logs / "footprint-floor.log"
                mark = LogMark.here(log)
                procs["floor"] = floor = await start(
                    [sys.executable, "-c", FLOOR, str(root / "floor.sock")], log
                )
                await wait_log(mark, "serving", floor)
            await asyncio.sleep(IDLE_SETTLE_S)
            for name, proc in procs.items():
                if proc.returncode is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}")

            def pids() -> dict[str, int | None]:
                return {name: proc.pid for name, proc in procs.items()}

            record.update(readings("idle", pids(), POD))
            record["floor_rss_mib"], record["floor_pss_mib"] = memory_mib(pids().get("floor"))
            async with Claims(api, n) as claims, PeakRss(pids) as peaks:
                started = time.monotonic()
                await claims.create()
                await asyncio.wait_for(claims.all_bound.wait(), timeout)
                record["provisioned_s"] = round(time.monotonic() - started, 2)
                started = time.monotonic()
                await claims.resize()
                await asyncio.wait_for(claims.all_resized.wait(), timeout)
                record["resized_s"] = round(time.monotonic() - started, 2)
            for name in POD:
                record[f"{name}_peak_rss_mib"] = peaks.peaks.get(name, math.nan)
            await asyncio.sleep(AFTER_SETTLE_S)
            record.update(readings("after", pids(), POD))
            for name, proc in procs.items():
                if proc.returncode is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}")
            print(
                "  "
                + ", ".join(
                    f"{name} {record[f'{name}_idle_rss_mib']}/{record[f'{name}_peak_rss_mib']}/"
                    f"{record[f'{name}_after_rss_mib']} MiB {record[f'{name}_start_s']} s"
                    for name in POD
                )
                + f"; pod {record['pod_idle_rss_mib']} MiB RSS, {record['pod_idle_pss_mib']} MiB PSS idle",
                flush=True,
            )
            return record
        finally:
            for proc in [*reversed(list(procs.values())), *helpers]:
                await stop_process(proc)
            await api.close()
            shutil.rmtree(root, ignore_errors=True)


ATTACH_PROCS = {
    "kubeloop": {"attacher": "external-attacher", "adc": "attach-detach-controller"},
    "go": {"attacher": "go-csi-attacher", "adc": "go-kcm-attachdetach"},
}


async def attach_side(ses: Any, comps: list[Component], side: str, timeout: float) -> dict[str, float]:
    """One side's attach controllers in bench.attach's session: idle, a pass, after."""
    from .attach import WARM_SETTLE_S, one_pass

    group = ShortHomeComponents(ses.stack.cp, comps, ses.stack.home)
    await group.start()
    names = ATTACH_PROCS[side]

    def pids() -> dict[str, int | None]:
        return {short: group.processes[full].pid for short, full in names.items() if full in group.processes}

    try:
        # One pod first, unmeasured, as bench.attach's passes start (kcm answers before its
        # controllers run; waiting before it, kcm's round after the first left that pod's
        # VolumeAttachment in place for minutes).
        await one_pass(ses.stack, ses.clock, ses.volumes[:1], f"footprint-{side}-warm", timeout)
        await asyncio.sleep(max(WARM_SETTLE_S, IDLE_SETTLE_S))
        record = readings("idle", pids(), ("attacher", "adc"))
        async with PeakRss(pids) as peaks:
            await one_pass(ses.stack, ses.clock, ses.volumes, f"footprint-{side}", timeout)
        record.update({f"{short}_peak_rss_mib": peaks.peaks.get(short, math.nan) for short in names})
        await asyncio.sleep(AFTER_SETTLE_S)
        record.update(readings("after", pids(), ("attacher", "adc")))
        return record
    finally:
        await group.stop()


def node_figures() -> tuple[method.Figure, ...]:
    figs = [
        method.Figure("pod_idle_rss_mib", "node pod RSS idle MiB (sum)"),
        method.Figure("pod_idle_pss_mib", "node pod PSS idle MiB (sum)"),
        method.Figure("pod_after_rss_mib", "node pod RSS after load MiB (sum)"),
        method.Figure("pod_after_pss_mib", "node pod PSS after load MiB (sum)"),
    ]
    for name in POD:
        figs += [
            method.Figure(f"{name}_idle_rss_mib", f"{name} RSS idle MiB"),
            method.Figure(f"{name}_idle_pss_mib", f"{name} PSS idle MiB"),
            method.Figure(f"{name}_peak_rss_mib", f"{name} peak RSS under load MiB"),
            method.Figure(f"{name}_after_rss_mib", f"{name} RSS after load MiB"),
            method.Figure(f"{name}_start_s", f"{name} start-up s"),
        ]
    figs += [
        method.Figure("floor_rss_mib", "grpc.aio floor RSS MiB"),
        method.Figure("floor_pss_mib", "grpc.aio floor PSS MiB"),
        method.Figure("provisioned_s", "N claims provisioned s"),
        method.Figure("resized_s", "N PVs resized s"),
    ]
    return tuple(figs)


def attach_figures() -> tuple[method.Figure, ...]:
    figs = []
    for short, label in (("attacher", "external-attacher"), ("adc", "attach-detach controller")):
        figs += [
            method.Figure(f"{short}_idle_rss_mib", f"{label} RSS idle MiB"),
            method.Figure(f"{short}_idle_pss_mib", f"{label} PSS idle MiB"),
            method.Figure(f"{short}_peak_rss_mib", f"{label} peak RSS under load MiB"),
            method.Figure(f"{short}_after_rss_mib", f"{label} RSS after load MiB"),
        ]
    return tuple(figs)


# One result per scenario (method.run reports every figure of a bench for each of its scenarios).
NODE_BENCH = method.Bench(
    name="footprint",
    title="the node-local DaemonSet pod's processes: RSS and PSS idle and under N claims provisioned "
    "and resized, start-up",
    sides={"kubeloop": "kubeloop", "go": "Go sidecars"},
    figures=node_figures(),
)
ATTACH_BENCH = method.Bench(
    name="footprint_attach",
    title="the attach controllers: RSS and PSS idle and over a pass of N pods",
    sides={"kubeloop": "kubeloop", "go": "Go (kcm, csi-attacher)"},
    figures=attach_figures(),
)
SCENARIOS = ("node", "attach")  # the default; `kind` (bench.footprint_kind) only when named


async def collect_node(args: argparse.Namespace) -> dict[str, list[method.Pair]]:
    async def one(side: str, _r: int) -> dict[str, float]:
        return await node_pod(side, args.claims, args.timeout)

    return {f"node pod, {args.claims} claims": await method.alternate(args.rounds, one, "node: ")}


async def collect_attach(args: argparse.Namespace) -> dict[str, list[method.Pair]]:
    from .attach import go_side, kubeloop_side, session

    async with session(args.pods, 50.0, 100, args.timeout) as ses:
        sides: dict[str, Callable[[], list[Component]]] = {
            "kubeloop": lambda: kubeloop_side(50.0, 100),
            "go": lambda: go_side(50.0, 100, str(ses.stack.cp.admin_kubeconfig)),
        }

        async def one(side: str, _r: int) -> dict[str, float]:
            return await attach_side(ses, sides[side](), side, args.timeout)

        return {f"attach, {args.pods} pods": await method.alternate(args.rounds, one, "attach: ")}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.footprint", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--claims",
        type=int,
        help=f"node and kind: claims (default: {CLAIMS_DEFAULT} for node, {KIND_CLAIMS_DEFAULT} for kind)",
    )
    parser.add_argument(
        "--pods", type=int, default=PODS_DEFAULT, help=f"attach: pods (default: {PODS_DEFAULT})"
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="node, attach (default: both) or kind (the node pod in kind, node-local mode)",
    )
    parser.add_argument("--no-build", action="store_true", help="kind: use the images docker has, build none")
    parser.add_argument(
        "--separate-sidecars",
        action="store_true",
        help="kind: node.embedSidecars=false (the provisioner and resizer in containers of their own; "
        "default: in the plugin's process, the chart's default)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="per load phase (default: 300s)")
    method.add_rounds_arg(parser, default=3)
    args = parser.parse_args()
    names = args.scenarios.split(",")
    kind_claims = args.claims or KIND_CLAIMS_DEFAULT
    args.claims = args.claims or CLAIMS_DEFAULT
    if "node" in names:
        method.run(NODE_BENCH, {"claims": args.claims}, lambda: collect_node(args))
    if "attach" in names:
        method.run(ATTACH_BENCH, {"pods": args.pods}, lambda: collect_attach(args))
    if "kind" in names:
        # Imported here: it needs the kind tests' helpers (and pytest), the other scenarios do not.
        from .footprint_kind import run as run_kind

        run_kind(kind_claims, build=not args.no_build, embed_sidecars=not args.separate_sidecars)


if __name__ == "__main__":
    main()
