"""bench.footprint's `kind` scenario: the node DaemonSet pod of the Helm chart's node-local mode as
a real kubelet runs it, in the cluster of `make kind-up KIND_POOLS=separate` (issue 49).

    python -m bench.footprint --scenarios kind [--claims 20] [--no-build]

The cluster is brought up by localstack.kind as `make kind-up KIND_POOLS=separate` does (images
built by its scripts unless --no-build), or reused when one with separate pools is up (either
storage-controller layout); it is left running (`make kind-down` takes it down). On the first
worker, the kubeloop node pod is deleted and made again by its DaemonSet (so a reused cluster's
earlier work is not in the idle reading), then its containers are read from inside the node
(`docker exec`):

- each container's processes (its memory cgroup's cgroup.procs; the container's main process found
  through containerd's task list): RSS and PSS from /proc/PID/smaps_rollup, its anonymous part
  (RssAnon) and the peak RSS since the process started (VmHWM) from /proc/PID/status, and the
  distinct pages (anonymous pages, and each mapped file's resident pages once: /proc/PID/smaps),
  for the pod what its processes hold together with the image's shared pages counted once;
- the container's memory cgroup as kubelet accounts it: the working set (usage minus the inactive
  file pages of memory.stat, what cAdvisor and `kubectl top` report), its anon and file pages and
  the cgroup's peak usage; and kubelet's own figure, the working set of its stats summary;
- the pod's sums over its containers, and the pod's cgroup (the pause container and all).

Read at idle (IDLE_SETTLE_S after every container is Ready), with N WaitForFirstConsumer claims
provisioned and mounted by N busybox pods placed on that worker (`loaded`), and after the pods and
claims were deleted and their volumes gone (`after`, AFTER_SETTLE_S later). One round. Writes
bench/results/footprint_kind.json (not a side-by-side result: bench.report leaves it out).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localstack import kind
from localstack.kind_workloads import SLEEP, claim, pod

from .common import print_table, write_results
from .footprint import smaps_rollup_mib

MIB = 2**20
IDLE_SETTLE_S = 30.0  # after every container of the pod is Ready
AFTER_SETTLE_S = 30.0  # after the load's volumes are gone
CLAIM_SIZE = "64Mi"
WFFC = "kubeloop-wffc"  # the chart's WaitForFirstConsumer class
NAMESPACE = "default"  # its ServiceAccount is there from the start; `make kind-down` cleans it
WAIT_S = 300
PHASES = ("idle", "loaded", "after")
# What a container reading holds (MiB): the processes' sums, then the cgroup's figures.
FIELDS = (
    "rss",
    "pss",
    "rss_anon",
    "distinct",
    "hwm",
    "working_set",
    "anon",
    "file",
    "cgroup_peak",
    "kubelet_working_set",
)
LABELS = {
    "rss": "RSS",
    "pss": "PSS",
    "rss_anon": "RSS anon",
    "distinct": "distinct pages",
    "hwm": "peak RSS (VmHWM)",
    "working_set": "cgroup working set",
    "anon": "cgroup anon",
    "file": "cgroup file",
    "cgroup_peak": "cgroup peak usage",
    "kubelet_working_set": "kubelet working set",
}


def kib_field(status: str, name: str) -> float:
    """A `Name:  N kB` line of /proc/PID/status, in MiB (NaN when absent)."""
    for line in status.splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1]) / 1024
    return math.nan


def get(cluster: kind.Cluster, *args: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json"))
    return result


def node_exec(node: str, *command: str) -> str:
    return kind.run(["docker", "exec", node, *command]).stdout


def node_files(node: str, paths: list[str]) -> dict[str, str]:
    """The text of files inside a kind node, in one `docker exec`; '' for one that cannot be read
    (a process gone meanwhile)."""
    script = 'for f in "$@"; do echo "=== $f"; cat "$f" 2>/dev/null; echo; done'
    out = node_exec(node, "sh", "-c", script, "sh", *paths)
    files: dict[str, list[str]] = {}
    current: list[str] = []
    for line in out.splitlines():
        if line.startswith("=== ") and line[4:] in paths:
            current = files[line[4:]] = []
        else:
            current.append(line)
    return {path: "\n".join(lines).rstrip("\n") for path, lines in files.items()}


def file_pages_kib(smaps: str) -> dict[str, int]:
    """The resident pages (KiB) of each file a process maps, from the text of /proc/PID/smaps: each
    file mapping's Rss less its Anonymous pages (copied on write, counted in RssAnon). Files are
    known by path: each container sees its image through an overlay mount of its own, so the same
    file of a shared image layer (whose page cache the containers share) has another device in
    each; the pod's two images have no path in common."""
    pages: dict[str, int] = {}
    key: str | None = None
    rss = 0
    for line in smaps.splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not line.startswith(head[0] + ":"):
            key = " ".join(head[5:]) if head[4] != "0" else None
        elif key is not None and line.startswith("Rss:"):
            rss = int(head[1])
        elif key is not None and line.startswith("Anonymous:"):
            pages[key] = pages.get(key, 0) + rss - int(head[1])
    return pages


def distinct_mib(anon_mib: float, processes: list[dict[str, int]]) -> float:
    """What a set of processes holds with each page counted once: their anonymous pages and, per
    file, the most of it any one of them has resident (the processes map the same pages of a
    shared library or interpreter; a lower bound where they touched different parts)."""
    files: dict[str, int] = {}
    for pages in processes:
        for key, kib in pages.items():
            files[key] = max(files.get(key, 0), kib)
    return anon_mib + sum(files.values()) / 1024


def memory_cgroup_dir(proc_cgroup: str) -> tuple[str, bool]:
    """The memory cgroup directory of a process inside its node, from /proc/PID/cgroup, and whether
    the hierarchy is cgroup v2."""
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return f"/sys/fs/cgroup/memory{path}", False
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return f"/sys/fs/cgroup{line[3:]}", True
    raise RuntimeError(f"no memory cgroup in {proc_cgroup!r}")


CGROUP_FILES = {
    # v1: usage, peak, and memory.stat's hierarchical totals.
    False: (
        "memory.usage_in_bytes",
        "memory.max_usage_in_bytes",
        "total_inactive_file",
        "total_rss",
        "total_cache",
    ),
    True: ("memory.current", "memory.peak", "inactive_file", "anon", "file"),
}


def cgroup_mib(files: dict[str, str], directory: str, v2: bool) -> dict[str, float]:
    """A memory cgroup's working set, anon, file and peak usage (MiB), as cAdvisor computes the
    working set: usage minus inactive file pages."""
    usage, peak, inactive, anon, file = CGROUP_FILES[v2]
    stat = dict(line.split() for line in files[f"{directory}/memory.stat"].splitlines() if line)

    def mib(text: str) -> float:
        return int(text) / MIB if text.strip().isdigit() else math.nan

    used = mib(files[f"{directory}/{usage}"])
    return {
        "working_set": used - max(0.0, mib(stat.get(inactive, "0"))),
        "anon": mib(stat.get(anon, "")),
        "file": mib(stat.get(file, "")),
        "cgroup_peak": mib(files.get(f"{directory}/{peak}", "")),
    }


def cgroup_paths(directory: str, v2: bool) -> list[str]:
    usage, peak, *_ = CGROUP_FILES[v2]
    return [f"{directory}/{name}" for name in ("cgroup.procs", "memory.stat", usage, peak)]


class NodePod:
    """The kubeloop node pod on one worker: its containers' cgroups and processes."""

    def __init__(self, cluster: kind.Cluster, node: str) -> None:
        self.cluster, self.node = cluster, node
        self.pod = self.find()
        self.containers = [c["name"] for c in self.pod["spec"]["containers"]]

    def find(self) -> dict[str, Any]:
        pods: list[dict[str, Any]] = get(
            self.cluster, "pods", "-n", "kube-system", "-l", "app.kubernetes.io/name=kubeloop",
            f"--field-selector=spec.nodeName={self.node}",
        )["items"]  # fmt: skip
        node_pods = [
            p
            for p in pods
            if any(o.get("kind") == "DaemonSet" for o in p["metadata"].get("ownerReferences", []))
        ]
        if len(node_pods) != 1:
            raise RuntimeError(f"{len(node_pods)} kubeloop DaemonSet pods on {self.node}")
        return node_pods[0]

    def restart(self) -> None:
        """A fresh pod (the DaemonSet makes it again once this one is deleted), so that the idle
        reading is a pod's first, whatever ran in a reused cluster before; then until every
        container of the new one is Ready (kubelet's probes pass)."""
        old = self.pod["metadata"]["name"]
        self.cluster.kubectl("delete", "-n", "kube-system", f"pod/{old}", "--wait=true", timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                self.pod = self.find()
                if self.pod["metadata"]["name"] != old:
                    break
            except RuntimeError:
                pass  # none on the node yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"the DaemonSet made no new pod on {self.node}")
            time.sleep(1)
        self.cluster.kubectl(
            "wait", "-n", "kube-system", "--for=condition=Ready", f"pod/{self.pod['metadata']['name']}",
            f"--timeout={WAIT_S}s", timeout=WAIT_S + 30,
        )  # fmt: skip
        self.pod = self.find()

    def restarts(self) -> dict[str, int]:
        self.pod = self.find()
        return {s["name"]: s.get("restartCount", 0) for s in self.pod["status"]["containerStatuses"]}

    def cgroups(self) -> tuple[dict[str, str], bool]:
        """Each container's memory cgroup directory inside the node (through its main process:
        containerd's task list), and whether the node runs cgroup v2."""
        ids = {
            s["containerID"].split("://", 1)[1]: s["name"] for s in self.pod["status"]["containerStatuses"]
        }
        tasks = node_exec(self.node, "ctr", "--namespace=k8s.io", "tasks", "list")
        pids = {
            ids[t[0]]: t[1] for t in (line.split() for line in tasks.splitlines()[1:]) if t and t[0] in ids
        }
        missing = [c for c in self.containers if c not in pids]
        if missing:
            raise RuntimeError(f"no containerd task for {missing} on {self.node}")
        files = node_files(self.node, [f"/proc/{pid}/cgroup" for pid in pids.values()])
        found = {name: memory_cgroup_dir(files[f"/proc/{pid}/cgroup"]) for name, pid in pids.items()}
        return {name: d for name, (d, _) in found.items()}, next(iter(found.values()))[1]

    def kubelet_working_sets(self) -> dict[str, float]:
        """Each container's working set (MiB) in kubelet's stats summary."""
        raw = self.cluster.kubectl("get", "--raw", f"/api/v1/nodes/{self.node}/proxy/stats/summary")
        uid = self.pod["metadata"]["uid"]
        for p in json.loads(raw).get("pods", []):
            if p["podRef"].get("uid") == uid:
                return {
                    c["name"]: c.get("memory", {}).get("workingSetBytes", math.nan) / MIB
                    for c in p.get("containers", [])
                }
        return {}

    def reading(self) -> dict[str, dict[str, float]]:
        """Per container and for the pod: the figures of FIELDS (MiB) and its process count."""
        dirs, v2 = self.cgroups()
        pod_dir = str(Path(next(iter(dirs.values()))).parent)
        paths = [p for d in [*dirs.values(), pod_dir] for p in cgroup_paths(d, v2)]
        files = node_files(self.node, paths)
        procs = {name: files[f"{d}/cgroup.procs"].split() for name, d in dirs.items()}
        proc_paths = [
            f"/proc/{pid}/{f}"
            for pids in procs.values()
            for pid in pids
            for f in ("smaps_rollup", "smaps", "status")
        ]
        files.update(node_files(self.node, proc_paths))
        kubelet = self.kubelet_working_sets()
        out: dict[str, dict[str, float]] = {}
        mapped: dict[str, list[dict[str, int]]] = {name: [] for name in self.containers}
        for name in self.containers:
            rec = {"rss": 0.0, "pss": 0.0, "rss_anon": 0.0, "hwm": 0.0, "processes": 0.0}
            for pid in procs[name]:
                rollup, status = (
                    files.get(f"/proc/{pid}/smaps_rollup", ""),
                    files.get(f"/proc/{pid}/status", ""),
                )
                if not rollup or not status:
                    continue  # gone meanwhile (a mkfs, a mount)
                rss, pss = smaps_rollup_mib(rollup)
                rec["rss"] += rss
                rec["pss"] += pss
                rec["rss_anon"] += kib_field(status, "RssAnon")
                rec["hwm"] += kib_field(status, "VmHWM")
                rec["processes"] += 1
                mapped[name].append(file_pages_kib(files.get(f"/proc/{pid}/smaps", "")))
            rec["distinct"] = distinct_mib(rec["rss_anon"], mapped[name])
            rec.update(cgroup_mib(files, dirs[name], v2))
            rec["kubelet_working_set"] = kubelet.get(name, math.nan)
            out[name] = {k: round(v, 1) for k, v in rec.items()}
        sums = out["pod (sum of containers)"] = {
            k: round(sum(out[c][k] for c in self.containers), 1) for k in (*FIELDS, "processes")
        }
        # Not a sum: the pod's pages once, whichever of its processes map them.
        everyone = [pages for name in self.containers for pages in mapped[name]]
        sums["distinct"] = round(distinct_mib(sums["rss_anon"], everyone), 1)
        pod_cgroup = cgroup_mib(files, pod_dir, v2)
        out["pod cgroup (pause included)"] = {k: round(v, 1) for k, v in pod_cgroup.items()}
        return out


def node_local_cluster(build: bool, embed_sidecars: bool) -> kind.Cluster:
    """The cluster of `make kind-up KIND_POOLS=separate`, brought up by localstack.kind; one up with
    separate pools is reused as it is (kubeloop's or the cluster's storage controllers), its release
    upgraded to `embed_sidecars` (the chart's node.embedSidecars)."""
    kind.run(["bash", "tools/docker-env.sh", "start"], timeout=180)
    cluster = kind.Cluster(pools="separate", embed_sidecars=embed_sidecars)
    made = cluster.created_layout() if cluster.exists() else None
    if made is not None and made.startswith("separate/"):
        cluster.storage_controllers = made.split("/", 1)[1]
    kind.up(cluster, build=build)
    return cluster


def load(
    cluster: kind.Cluster, node: str, n: int, read: Callable[[], dict[str, dict[str, float]]]
) -> dict[str, Any]:
    """N WaitForFirstConsumer claims and N busybox pods on `node`, every pod Ready (its volume
    provisioned on that node, staged and published); `read()` then; pods and claims deleted, every
    volume gone. Returns the reading and the phases' seconds."""
    timings: dict[str, Any] = {}
    names = [f"footprint-{i:02d}" for i in range(n)]
    pods, claims = [f"pod/{name}" for name in names], [f"pvc/{name}" for name in names]
    ns = ["-n", NAMESPACE]
    started = time.monotonic()
    cluster.kubectl(
        "apply", "-f", "-", input="---".join(claim(NAMESPACE, c, CLAIM_SIZE, WFFC) for c in names)
    )
    cluster.kubectl("apply", "-f", "-", input="---".join(pod(NAMESPACE, p, p, node, SLEEP) for p in names))
    wait = [f"--timeout={WAIT_S}s"]
    cluster.kubectl("wait", *ns, "--for=condition=Ready", *pods, *wait, timeout=WAIT_S + 30)
    timings["pods_ready_s"] = round(time.monotonic() - started, 1)
    volumes = [
        f"pv/{c['spec']['volumeName']}"
        for c in get(cluster, *ns, "pvc")["items"]
        if c["metadata"]["name"] in names
    ]
    timings["loaded"] = read()
    started = time.monotonic()
    cluster.kubectl("delete", *ns, *pods, *claims, "--wait=true", *wait, timeout=WAIT_S + 30)
    cluster.kubectl("wait", "--for=delete", *volumes, *wait, timeout=WAIT_S + 30)
    timings["deleted_s"] = round(time.monotonic() - started, 1)
    return timings


def table(result: dict[str, Any]) -> None:
    phases = result["phases"]
    rows = []
    for name in phases["idle"]:
        for phase in PHASES:
            rec = phases[phase][name]
            rows.append([name, phase, *(f"{rec[k]:.1f}" if k in rec else "" for k in FIELDS)])
    print_table(
        f"footprint_kind: the node pod on {result['node']}, {result['params']['claims']} claims, "
        f"node.embedSidecars={str(result['params']['embed_sidecars']).lower()} "
        f"(one round; MiB)",
        ["container", "phase", *(LABELS[k] for k in FIELDS)],
        rows,
    )


def run(claims: int, build: bool, embed_sidecars: bool = True) -> Path:
    cluster = node_local_cluster(build, embed_sidecars)
    node = kind.worker_names(cluster.name, kind.SEPARATE_WORKERS)[0]
    node_pod = NodePod(cluster, node)
    node_pod.restart()
    time.sleep(IDLE_SETTLE_S)
    phases = {"idle": node_pod.reading()}
    timings = load(cluster, node, claims, node_pod.reading)
    phases["loaded"] = timings.pop("loaded")
    time.sleep(AFTER_SETTLE_S)
    phases["after"] = node_pod.reading()
    result = {
        "title": "the node-local DaemonSet pod in kind: per container RSS, PSS, cgroup working set",
        "params": {"claims": claims, "claim_size": CLAIM_SIZE, "embed_sidecars": embed_sidecars},
        "rounds": 1,
        "cluster": cluster.layout,
        "node": node,
        "containers": node_pod.containers,
        "restarts": node_pod.restarts(),
        # PSS shares a page among every process of the node that maps it, these pods' too.
        "pods_on_node": sorted(
            f"{p['metadata']['namespace']}/{p['metadata']['name']}"
            for p in get(cluster, "pods", "-A", f"--field-selector=spec.nodeName={node}")["items"]
        ),
        "timings": timings,
        "phases": phases,
    }
    table(result)
    path = write_results("footprint_kind" if embed_sidecars else "footprint_kind_separate", result)
    print(f"\nresults: {path}\ncluster {cluster.name} left running: make kind-down", flush=True)
    return path
