"""bench/memory: the resident memory kubeloop's pv-controller spends on N bound PersistentVolumes
(and their N claims), side by side with the share of kube-controller-manager's RSS that its
persistentvolume-binder takes for the same objects (issue 16: "RSS per 10k PVs within 2x of kcm's
binder share").

    python -m bench.memory [--pvs 10000] [--rounds 3]

One control plane for the whole run. Each side is measured twice per round, at a steady state: the
process is started, and its RSS read once it has synced and gone idle (at least one resync period
past its start, no write to PVs, claims or events and its RSS steady over the last 10 s):

1. against the empty cluster (only the namespace): the process's fixed cost;
2. after N PVs shaped like provisioned CSI volumes (bench.informer_sync's, with node affinity,
   finalizers and a CSI source) and their N claims, pre-bound both ways and made Bound by an
   unmeasured warm-up run of kubeloop's pv-controller, so neither measured side writes.

The Go side is kcm with only `--controllers=persistentvolume-binder-controller`; its baseline is the
same kcm with only `ttl-controller` (it watches nodes, of which there are none) on the full cluster,
so kcm's binder share is RSS(binder) - RSS(baseline), both at N. kubeloop's pv-controller is the
binder alone, so its share is what N objects add: RSS at N - RSS on the empty cluster. Reported per
side: both RSS readings, the growth per 10,000 PVs (RSS at N - RSS empty, scaled), the bytes per
PV (with its claim), the binder share, and for kcm the baseline. Rounds alternate kubeloop and kcm
(bench/method.py; default 3 rounds: each takes about 3 minutes at 10,000 PVs on 2 cores).
Writes bench/results/memory.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller_runtime.client import ApiClient
from controller_runtime.resources import (
    NAMESPACES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    STORAGE_CLASSES,
    Obj,
)
from controller_runtime.toolchain import REPO_ROOT
from localstack.controlplane import ControlPlane
from localstack.proc import free_ports
from services.pv_controller.controller import Options

from . import method
from .binding import NAMESPACE, Observer, kcm_side_argv, kubeloop_argv, write_count
from .common import control_plane, kcm_argv, rss_bytes, start, stop_process
from .informer_sync import pv

MIB = 2**20
PER = 10_000  # the target is stated per 10,000 PVs
QPS, BURST = 5000.0, 10000  # unthrottled: a measured run makes no writes, the warm-up makes 2 per pair
# A run is idle once its RSS moved less than this over the window and nothing was written.
SETTLE_WINDOW_S = 10.0
SETTLE_TOLERANCE = 0.01
# Both controllers resync every 15 s: a reading before the first resync could miss its garbage.
SETTLE_MIN_S = 20.0
# kcm with a controller that watches nothing the bench creates: its libraries, client and servers.
KCM_BASELINE_CONTROLLERS = "ttl-controller"
CLASS = "kubeloop"  # informer_sync's PVs name this class


@dataclass
class Reading:
    """One process's steady state: its RSS once idle, the highest RSS it reached, and how long it
    took to settle."""

    rss_mib: float
    peak_rss_mib: float
    settle_s: float


@dataclass
class Record:
    """One side's figures in one round (the method's per-round record)."""

    pvs: int
    rss_empty_mib: float  # on the empty cluster
    rss_mib: float  # with N PVs and claims
    peak_rss_mib: float
    baseline_mib: float  # kcm: ttl-controller only, at N; kubeloop: its own empty-cluster RSS
    share_mib: float  # the binder's share of the process at N
    growth_per_10k_mib: float  # (RSS at N - RSS empty) per 10,000 PVs
    bytes_per_pv: float
    settle_s: float


def derive(pvs: int, empty: Reading, full: Reading, baseline_mib: float | None) -> Record:
    """A side's record from its readings; `baseline_mib` is kcm's baseline process at N (None for
    kubeloop, whose baseline is its own empty-cluster reading)."""
    growth = full.rss_mib - empty.rss_mib
    base = empty.rss_mib if baseline_mib is None else baseline_mib
    return Record(
        pvs=pvs,
        rss_empty_mib=round(empty.rss_mib, 1),
        rss_mib=round(full.rss_mib, 1),
        peak_rss_mib=round(full.peak_rss_mib, 1),
        baseline_mib=round(base, 1),
        share_mib=round(full.rss_mib - base, 1),
        growth_per_10k_mib=round(growth * PER / pvs, 1),
        bytes_per_pv=round(growth * MIB / pvs),
        settle_s=round(full.settle_s, 1),
    )


def settled(samples: list[tuple[float, float]], window: float, tolerance: float) -> bool:
    """True when the (time, RSS) samples cover `window` seconds up to the last one and their RSS
    stayed within `tolerance` (a fraction) of the last."""
    if not samples or samples[-1][0] - samples[0][0] < window:
        return False
    last_t, last = samples[-1]
    recent = [rss for t, rss in samples if t >= last_t - window]
    return max(recent) - min(recent) <= tolerance * last


def pvc(i: int) -> Obj:
    """The claim informer_sync's PV `i` names, already pointing at it (as after a bind)."""
    return {
        "metadata": {
            "name": f"data-{i}",
            "annotations": {
                "pv.kubernetes.io/bind-completed": "yes",
                "volume.kubernetes.io/storage-provisioner": "loop.csi.kubeloop.dev",
            },
            "finalizers": ["kubernetes.io/pvc-protection"],
        },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
            "storageClassName": CLASS,
            "volumeMode": "Filesystem",
            "volumeName": pv(i)["metadata"]["name"],
        },
    }


async def populate(api: ApiClient, n: int) -> None:
    """N claims, then N PVs whose claimRef carries each claim's uid."""
    await api.create(
        STORAGE_CLASSES,
        {"metadata": {"name": CLASS}, "provisioner": "loop.csi.kubeloop.dev", "reclaimPolicy": "Delete"},
    )
    sem = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        async with sem:
            claim = await api.create(PERSISTENT_VOLUME_CLAIMS, pvc(i), NAMESPACE)
            volume = pv(i)
            volume["spec"]["claimRef"].update(namespace=NAMESPACE, uid=claim["metadata"]["uid"])
            await api.create(PERSISTENT_VOLUMES, volume)

    started = time.monotonic()
    for chunk in range(0, n, 1000):
        await asyncio.gather(*(one(i) for i in range(chunk, min(n, chunk + 1000))))
        print(f"  created {min(n, chunk + 1000)}/{n} claims and PVs", flush=True)
    print(f"  populated in {time.monotonic() - started:.0f} s", flush=True)


async def bind_all(cp: ControlPlane, api: ApiClient, n: int, logs: Path) -> None:
    """The unmeasured warm-up: kubeloop's pv-controller moves every pre-bound pair to Bound."""
    observer = Observer(api, n)
    await observer.start()
    proc = await start(kubeloop_argv(cp, QPS, BURST, 16, Options.binds_in_flight), logs / "memory-warmup.log")
    started = time.monotonic()
    try:
        await asyncio.wait_for(observer.done.wait(), 120 + n / 20)
    finally:
        await stop_process(proc)
        await observer.stop()
    print(f"  {n} claims Bound in {time.monotonic() - started:.0f} s (warm-up)", flush=True)


async def steady_rss(
    argv: list[str], log: Path, api: ApiClient, timeout: float, min_s: float = SETTLE_MIN_S
) -> Reading:
    """Starts `argv`, waits until it is idle (see the module doc), at least `min_s`, and returns
    its RSS then."""
    proc = await start(argv, log)
    assert proc.pid is not None
    started = time.monotonic()
    samples: list[tuple[float, float]] = []
    writes: list[tuple[float, int]] = []
    peak = 0.0
    try:
        while True:
            await asyncio.sleep(1.0)
            if proc.returncode is not None:
                raise RuntimeError(f"{argv[0]} exited with {proc.returncode}; see {log}")
            now = time.monotonic()
            rss = rss_bytes(proc.pid) / MIB
            peak = max(peak, rss)
            samples.append((now, rss))
            writes.append((now, await write_count(api)))
            recent_writes = {w for t, w in writes if t >= now - SETTLE_WINDOW_S}
            if (
                now - started >= min_s
                and len(recent_writes) == 1
                and settled(samples, SETTLE_WINDOW_S, SETTLE_TOLERANCE)
            ):
                return Reading(rss, peak, now - started)
            if now - started > timeout:
                raise TimeoutError(f"{argv[0]} did not settle in {timeout:.0f} s; see {log}")
    finally:
        await stop_process(proc)


FIGURES = (
    method.Figure("share_mib", "binder share MiB"),
    method.Figure("growth_per_10k_mib", "growth per 10k PVs MiB"),
    method.Figure("bytes_per_pv", "bytes per PV (+claim)"),
    method.Figure("rss_mib", "RSS at N MiB"),
    method.Figure("rss_empty_mib", "RSS empty MiB"),
    method.Figure("baseline_mib", "baseline MiB"),
    method.Figure("peak_rss_mib", "peak RSS MiB"),
)

BENCH = method.Bench(
    name="memory",
    title="steady-state RSS with N bound PVs and claims",
    sides={"kubeloop": "kubeloop pv-controller", "go": "kcm persistentvolume-binder"},
    figures=FIGURES,
)


async def collect(n: int, rounds: int, timeout: float, min_s: float) -> dict[str, list[method.Pair]]:
    logs = REPO_ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    async with control_plane() as cp:
        api = await ApiClient.from_kubeconfig(str(cp.admin_kubeconfig), qps=0, burst=1, user_agent="bench")
        try:
            await api.create(NAMESPACES, {"metadata": {"name": NAMESPACE}})
            kubeconfig = str(cp.admin_kubeconfig)

            def kcm(controllers: str) -> Callable[[], list[str]]:
                return lambda: kcm_argv(controllers, kubeconfig, QPS, BURST, free_ports(1)[0])

            argv: dict[str, Callable[[], list[str]]] = {
                "kubeloop": lambda: kubeloop_argv(cp, QPS, BURST, 16, Options.binds_in_flight),
                "go": lambda: kcm_side_argv(cp, QPS, BURST, 0, 0),
            }

            async def measure(side: str, r: int, what: str) -> Reading:
                log = logs / f"memory-{what}-{side}-{r}.log"
                return await steady_rss(argv[side](), log, api, timeout, min_s)

            empty: dict[tuple[str, int], Reading] = {}

            async def one_empty(side: str, r: int) -> dict[str, float]:
                empty[side, r] = await measure(side, r, "empty")
                return {"rss_mib": empty[side, r].rss_mib}

            await method.alternate(rounds, one_empty, "empty cluster: ")
            print(f"creating {n} claims and PVs ...", flush=True)
            await populate(api, n)
            await bind_all(cp, api, n, logs)

            async def one_full(side: str, r: int) -> Record:
                full = await measure(side, r, "full")
                baseline = None
                if side == "go":
                    log = logs / f"memory-full-kcm-baseline-{r}.log"
                    kcm_base = kcm(KCM_BASELINE_CONTROLLERS)()
                    baseline = (await steady_rss(kcm_base, log, api, timeout, min_s)).rss_mib
                return derive(n, empty[side, r], full, baseline)

            return {f"{n} PVs": await method.alternate(rounds, one_full, f"{n} PVs: ")}
        finally:
            await api.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pvs", type=int, default=PER, help=f"bound PV/claim pairs (default: {PER})")
    method.add_rounds_arg(parser, default=3)
    parser.add_argument(
        "--settle-min",
        type=float,
        default=SETTLE_MIN_S,
        help=f"read no process's RSS earlier than this after its start (default: {SETTLE_MIN_S:g}s); "
        "Go returns freed heap to the system gradually, so a longer wait shows kcm's later RSS",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="per measured process (default: 300s)")
    parser.add_argument("--output", default=BENCH.name, help="results name: bench/results/NAME.json")
    args = parser.parse_args()
    params: dict[str, Any] = {"pvs": args.pvs, "settle min s": args.settle_min}
    bench = dataclasses.replace(BENCH, name=args.output)
    timeout = max(args.timeout, args.settle_min + 120)
    method.run(bench, params, lambda: collect(args.pvs, args.rounds, timeout, args.settle_min))


if __name__ == "__main__":
    main()
