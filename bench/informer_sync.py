"""bench/informer_sync: a kubeloop informer's initial list+sync of N PersistentVolumes, and its RSS
growth, side by side with `kubectl get pv -o json` (fetch and decode) on the same apiserver.

    python -m bench.informer_sync [--pvs 10000] [--runs 3] [--kubeconfig PATH]

Without --kubeconfig it starts its own etcd + kube-apiserver from the cached binaries. Each informer
run is a fresh child process, so its RSS growth is the cache and nothing else. Prints a table and
writes bench/results/informer_sync.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

from controller_runtime.client import ApiClient
from controller_runtime.resources import PERSISTENT_VOLUMES, Obj
from controller_runtime.toolchain import Toolchain

from .common import control_plane, median, print_table, rss_bytes, write_results

LABEL = "bench=informer-sync"


def pv(i: int) -> Obj:
    """A PV shaped like one external-provisioner makes (CSI source, claimRef, node affinity)."""
    name = f"pvc-{i:08d}-0000-4000-8000-{i:012d}"
    return {
        "metadata": {
            "name": name,
            "labels": {"bench": "informer-sync"},
            "annotations": {
                "pv.kubernetes.io/provisioned-by": "loop.csi.kubeloop.dev",
                "volume.kubernetes.io/provisioner-deletion-secret-name": "",
                "volume.kubernetes.io/provisioner-deletion-secret-namespace": "",
            },
            "finalizers": [
                "kubernetes.io/pv-protection",
                "external-provisioner.volume.kubernetes.io/finalizer",
            ],
        },
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": "kubeloop",
            "volumeMode": "Filesystem",
            "claimRef": {
                "kind": "PersistentVolumeClaim",
                "namespace": "default",
                "name": f"data-{i}",
                "uid": f"{i:08d}-0000-4000-8000-{i:012d}",
                "apiVersion": "v1",
            },
            "csi": {
                "driver": "loop.csi.kubeloop.dev",
                "volumeHandle": name,
                "fsType": "ext4",
                "volumeAttributes": {
                    "storage.kubernetes.io/csiProvisionerIdentity": "1700000000000-8081-loop.csi.kubeloop.dev"
                },
            },
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": "topology.loop.csi.kubeloop.dev/node",
                                    "operator": "In",
                                    "values": ["node-a"],
                                }
                            ]
                        }
                    ]
                }
            },
        },
    }


async def populate(kubeconfig: str, count: int) -> None:
    api = await ApiClient.from_kubeconfig(kubeconfig, qps=0, burst=1)
    try:
        existing, _ = await api.list_all(PERSISTENT_VOLUMES, labelSelector=LABEL)
        have = {o["metadata"]["name"] for o in existing}
        todo = [i for i in range(count) if pv(i)["metadata"]["name"] not in have]
        start = time.perf_counter()
        sem = asyncio.Semaphore(64)

        async def create(i: int) -> None:
            async with sem:
                await api.create(PERSISTENT_VOLUMES, pv(i))

        for chunk in range(0, len(todo), 1000):
            await asyncio.gather(*(create(i) for i in todo[chunk : chunk + 1000]))
            print(f"  created {min(chunk + 1000, len(todo))}/{len(todo)} PVs", file=sys.stderr)
        if todo:
            print(f"  populated {len(todo)} PVs in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    finally:
        await api.close()


async def child(kubeconfig: str) -> dict[str, Any]:
    """Runs in a fresh process: one informer's initial list + sync, and the RSS it added."""
    from controller_runtime.informer import SharedInformer

    api = await ApiClient.from_kubeconfig(kubeconfig, qps=0, burst=1)
    await api.request("GET", "/version")  # connection and TLS set up outside the timing
    gc.collect()
    before = rss_bytes()
    informer = SharedInformer(api, PERSISTENT_VOLUMES)
    start = time.perf_counter()
    informer.start()
    await informer.wait_for_sync()
    elapsed = time.perf_counter() - start
    gc.collect()
    after = rss_bytes()
    objects = len(informer.store)
    await informer.stop()
    await api.close()
    return {"sync_seconds": elapsed, "objects": objects, "rss_growth_bytes": after - before}


async def run_child(kubeconfig: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.informer_sync",
        "--child",
        "--kubeconfig",
        kubeconfig,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError("informer child failed")
    result: dict[str, Any] = json.loads(out)
    return result


async def run_kubectl(kubeconfig: str) -> dict[str, Any]:
    kubectl = Toolchain.default().binary("kubectl")
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        str(kubectl),
        f"--kubeconfig={kubeconfig}",
        "get",
        "pv",
        "-o",
        "json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl failed: {err.decode()}")
    return {"seconds": elapsed, "objects": len(json.loads(out)["items"])}


async def measure(kubeconfig: str, pvs: int, runs: int) -> dict[str, Any]:
    await populate(kubeconfig, pvs)
    informer_runs, kubectl_runs = [], []
    for n in range(runs):
        # Alternate the order so neither side always gets the warmer apiserver cache.
        pair = [run_child(kubeconfig), run_kubectl(kubeconfig)]
        if n % 2:
            k = await pair[1]
            i = await pair[0]
        else:
            i = await pair[0]
            k = await pair[1]
        informer_runs.append(i)
        kubectl_runs.append(k)
        print(
            f"  run {n + 1}: informer {i['sync_seconds']:.2f}s ({i['objects']} objects), "
            f"kubectl {k['seconds']:.2f}s",
            file=sys.stderr,
        )
    sync = median([r["sync_seconds"] for r in informer_runs])
    kube = median([r["seconds"] for r in kubectl_runs])
    objects = informer_runs[0]["objects"]
    rss_per = median([r["rss_growth_bytes"] for r in informer_runs]) / max(1, objects)
    return {
        "pvs": pvs,
        "objects_in_cluster": objects,
        "runs": runs,
        "informer_sync_seconds_median": sync,
        "kubectl_get_seconds_median": kube,
        "ratio_informer_to_kubectl": sync / kube,
        "rss_growth_bytes_per_pv": rss_per,
        "targets": {"sync_no_slower_than_kubectl": sync <= kube, "rss_per_pv_under_4096": rss_per < 4096},
        "informer_runs": informer_runs,
        "kubectl_runs": kubectl_runs,
    }


async def main_async(args: argparse.Namespace) -> None:
    if args.child:
        print(json.dumps(await child(args.kubeconfig)))
        return
    if args.kubeconfig:
        result = await measure(args.kubeconfig, args.pvs, args.runs)
    else:
        async with control_plane() as cp:
            result = await measure(str(cp.admin_kubeconfig), args.pvs, args.runs)
    print_table(
        f"informer_sync: {result['objects_in_cluster']} PVs, median of {result['runs']} runs",
        ["measure", "kubeloop informer", "kubectl get pv -o json", "ratio"],
        [
            [
                "list + decode (+ index) seconds",
                f"{result['informer_sync_seconds_median']:.3f}",
                f"{result['kubectl_get_seconds_median']:.3f}",
                f"{result['ratio_informer_to_kubectl']:.2f}",
            ],
            [
                "RSS growth per cached PV",
                f"{result['rss_growth_bytes_per_pv']:.0f} B",
                "-",
                "target < 4096 B",
            ],
        ],
    )
    path = write_results("informer_sync", result)
    print(f"\nresults: {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pvs", type=int, default=10_000, help="PersistentVolumes to create (default 10000)")
    parser.add_argument("--runs", type=int, default=3, help="measured runs; the median is reported")
    parser.add_argument("--kubeconfig", default="", help="use this cluster instead of starting one")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import uvloop

    uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
