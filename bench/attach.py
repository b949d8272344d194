"""bench/attach: attach + mount and unmount + detach of many pods, kubeloop's attach-detach
controller and external-attacher side by side with kube-controller-manager's attach-detach
controller (the cached kcm binary with only `--controllers=persistentvolume-attach-detach-controller`)
and the Go external-attacher (csi-attacher, tools/build-binaries.sh external-attacher).

    python -m bench.attach [--pods 20] [--rounds 5] [--qps 50 --burst 100]

Both sides share one control plane and everything else: the real CSI driver (controller mode and
a node plugin per node), kubeloop's node agent on node-a and node-b, the pv-controller, and the
same N static volumes pre-bound to N claims. Each measured pass creates N pods (half per node) and
records, per pod, pod creation → Running (its volume attached and mounted), then deletes them all
and records pod deletion → VolumeAttachment gone. The controllers of both sides use the same
client QPS/burst. A first unmeasured pass formats every volume (mkfs runs once per volume), so
no side pays for it; then the rounds run kubeloop, then Go (bench/method.py). Needs root. Writes
bench/results/attach.json.

    python -m bench.attach --pods 100 --rounds 2 --isolate

With --isolate, two more scenarios follow the default one, each putting one of kubeloop's two
controllers beside the other's Go counterpart (kubeloop's attach-detach controller with
csi-attacher, kcm with kubeloop's external-attacher) against Go's pair: which of the two a gap
belongs to, when the two sides share one apiserver, etcd and two cores.

    python -m bench.attach --pods 100 --rounds 3 --floor

With --floor, a last scenario measures what no attach-detach controller or attacher can go
below: its kubeloop column starts the pods while neither runs, every volume attached and listed by
its node beforehand (by kubeloop's controllers, for pods made and deleted first), against Go's full
pass. Its mount figures are the shared parts' alone; "mount: all CPU per pod ms" beside the full
passes' shows what the attach work adds.

    python -m bench.attach --pods 100 --rounds 3 --creation

With --creation, a last scenario measures the first stage alone on both sides: each side's
attach-detach controller runs by itself until every pod's VolumeAttachment exists, and only then
does its attacher start (the pods then run and are deleted as in a full pass, unmeasured). No
attacher writes and the node side has nothing to mount while the VolumeAttachments are made, so its
"VA created" figures are the controller's own, beside "pod created" (when the bench's watch saw
each pod).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from controller_runtime.client import ApiClient
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.resources import NAMESPACES, PODS, VOLUME_ATTACHMENTS, Obj, Resource
from controller_runtime.resources import NODES as NODE_OBJECTS
from controller_runtime.toolchain import MissingBinaryError
from controller_runtime.volumes import unique_volume_name, va_name
from csi_driver import DRIVER_NAME
from csi_driver.main import MAX_VOLUMES_PER_NODE
from localstack.components import Component, ComponentContext
from localstack.go_sidecars import ATTACHER, go_sidecar_binary
from localstack.proc import free_ports
from localstack.storage_stack import NODES, ShortHomeComponents, StorageStack, storage_components

from . import method
from .common import CpuUse, PeakRss, control_plane, kcm_argv, percentile
from .work import WorkCounts

NAMESPACE = "bench-attach"
PRE_ATTACHED = "pre-attached"
CREATION = "creation"
# After the unmeasured pod: kcm ends its detach of that pod's volume up to half a second after the
# VolumeAttachment is gone, and the measured pod on the same volume would wait for it (found with
# the creation scenario: that one pod's VA came 0.5 s after the others').
WARM_SETTLE_S = 1.0
COMMON = ("pv-controller", "csi-driver-controller", "csi-driver-node", "node-agent")
NODE_SIDE = ("csi-driver-node", "node-agent")  # name prefixes: one process of each per node
# Small enough that `make bench` (5 rounds of each side) fits its 30 minutes on 2 cores.
PODS_DEFAULT = 20


@dataclass
class Pass:
    pods: int
    # Where a pod's time goes, p50 from its creation: VolumeAttachment created, attached, listed
    # in the node's volumesAttached (the node side starts there), pod Running.
    va_created_p50_s: float
    va_attached_p50_s: float
    node_listed_p50_s: float
    mount_p50_s: float
    mount_p99_s: float
    mount_total_s: float
    # Where a pod's detach time goes, p50 from its deletion: the node stopped reporting the
    # volume in use (the controllers may detach from there), the VA got its deletion.
    node_unused_p50_s: float
    va_deleting_p50_s: float
    detach_p50_s: float
    detach_p99_s: float
    detach_total_s: float
    # The highest RSS of each of the side's controller processes over the pass (MiB).
    peak_rss_mib: dict[str, float] = dataclasses.field(default_factory=dict)
    # When the bench's watch saw the pod (created) and its deletionTimestamp (deleted), p50 from
    # the bench's request: the apiserver's and the bench client's share, neither side's work (the
    # bench sends at most 8 requests at once, so the last of a burst wait for a connection).
    pod_seen_p50_s: float = math.nan
    deletion_seen_p50_s: float = math.nan
    # CPU seconds while the pods were made Running (mount all s) and while they were detached
    # (detach all s): the side's controllers; the node side both sides share (node agents and CSI
    # node plugins); kube-apiserver and etcd. Beside 2 cores x that phase's wall time, they show how
    # much of the machine the shared part leaves to the side. `cpu_s` keeps each process's.
    mount_side_cpu_s: float = math.nan
    mount_node_cpu_s: float = math.nan
    mount_server_cpu_s: float = math.nan
    detach_side_cpu_s: float = math.nan
    detach_node_cpu_s: float = math.nan
    detach_server_cpu_s: float = math.nan
    cpu_s: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    # Work per pod over the pass, attach and detach (bench.work): API requests the apiserver served
    # (the shared node side's included, the same on both sides), in total and by verb and resource.
    api_requests_per_op: float = math.nan
    api_requests: dict[str, float] = dataclasses.field(default_factory=dict)
    # The apiserver's mean time serving each kind of request (ms): its share of their latency.
    api_server_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    # The mean wait for a seat in the apiserver's flow control, by priority level (ms).
    flow_control_wait_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    # CPU seconds of every process above (side, node side, apiserver, etcd, pv-controller, CSI
    # controller plugin) while the pods were made Running, per pod (ms): the whole pipeline's cost.
    mount_cpu_per_pod_ms: float = math.nan
    # The tails of the first two stages, p99 from the pod's creation.
    va_created_p99_s: float = math.nan
    va_attached_p99_s: float = math.nan
    # When the bench's watch saw the last pods: no VolumeAttachment can be made before its pod.
    pod_seen_p99_s: float = math.nan

    @classmethod
    def partial(cls, pods: int, **figures: Any) -> Pass:
        """A pass that measures only `figures` (a scenario that skips stages): the other figures
        are NaN, the other records empty."""
        unmeasured = {
            f.name: math.nan
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        return cls(**{**unmeasured, "pods": pods, **figures})


def kubeloop_side(qps: float, burst: int) -> list[Component]:
    def with_qps(comp: Component) -> Component:
        base = comp.argv
        return dataclasses.replace(
            comp, argv=lambda c: [*base(c), f"--kube-api-qps={qps}", f"--kube-api-burst={burst}"]
        )

    return [with_qps(c) for c in storage_components(("external-attacher", "attach-detach-controller"))]


# The Go side's two components, and the kubeloop controller each stands for.
GO_ATTACHER = "go-csi-attacher"
GO_KCM = "go-kcm-attachdetach"
GO_COUNTERPART = {"attach-detach-controller": GO_KCM, "external-attacher": GO_ATTACHER}


def go_side(qps: float, burst: int, admin_kubeconfig: str) -> list[Component]:
    try:
        attacher = go_sidecar_binary(ATTACHER)
    except MissingBinaryError as exc:
        sys.exit(str(exc))
    (port,) = free_ports(1)

    def kcm_side_argv(_c: ComponentContext) -> list[str]:
        return kcm_argv("persistentvolume-attach-detach-controller", admin_kubeconfig, qps, burst, port)

    def attacher_argv(c: ComponentContext) -> list[str]:
        return [
            str(attacher),
            f"--csi-address={c.home / 'components' / 'csi-driver-controller' / 'csi.sock'}",
            f"--kubeconfig={admin_kubeconfig}",
            "--timeout=15s",
            "--worker-threads=10",
            f"--kube-api-qps={qps}",
            f"--kube-api-burst={burst}",
        ]

    return [
        Component(name=GO_ATTACHER, argv=attacher_argv, health_path=None),
        Component(name=GO_KCM, argv=kcm_side_argv, health_path=None),
    ]


class Clock:
    """Client-side times at which pods became Running and VolumeAttachments appeared, became
    attached, were listed by their node and disappeared."""

    def __init__(self, pods: SharedInformer, vas: SharedInformer, nodes: SharedInformer) -> None:
        self.running: dict[str, float] = {}
        self.pod_seen: dict[str, float] = {}
        self.deletion_seen: dict[str, float] = {}
        self.va_created: dict[str, float] = {}
        self.va_attached: dict[str, float] = {}
        self.listed: dict[tuple[str, str], float] = {}  # (node, unique volume name)
        self.va_gone: dict[str, float] = {}
        # Detach side: the node no longer reports the volume in use; the VA got its deletion.
        self.unused: dict[tuple[str, str], float] = {}
        self.va_deleting: dict[str, float] = {}
        self._unused_watch: set[tuple[str, str]] = set()
        self._pods = pods
        pods.add_handler(EventHandler(self._pod, lambda _o, n: self._pod(n), None))
        vas.add_handler(EventHandler(self._va_seen, lambda _o, n: self._va_seen(n), self._va))
        nodes.add_handler(EventHandler(self._node, lambda _o, n: self._node(n), None))

    def _va_seen(self, va: Obj) -> None:
        now, name = time.monotonic(), va["metadata"]["name"]
        self.va_created.setdefault(name, now)
        if (va.get("status") or {}).get("attached"):
            self.va_attached.setdefault(name, now)
        if va["metadata"].get("deletionTimestamp"):
            self.va_deleting.setdefault(name, now)

    def _node(self, node: Obj) -> None:
        now, name = time.monotonic(), node["metadata"]["name"]
        status = node.get("status") or {}
        for entry in status.get("volumesAttached") or ():
            self.listed.setdefault((name, str(entry.get("name", ""))), now)
        in_use = set(status.get("volumesInUse") or ())
        for key in self._unused_watch:
            if key[0] == name and key[1] not in in_use:
                self.unused.setdefault(key, now)

    def watch_unused(self, keys: set[tuple[str, str]]) -> None:
        """From now on, marks when each (node, unique volume name) leaves its node's volumesInUse."""
        self._unused_watch = set(keys)

    def forget(self, vas: dict[str, tuple[str, str]]) -> None:
        """Drops the marks of a pass's VolumeAttachments (name -> (node, unique volume name))."""
        for va, listed in vas.items():
            for marks in (self.va_created, self.va_attached, self.va_gone, self.va_deleting):
                marks.pop(va, None)
            self.listed.pop(listed, None)
            self.unused.pop(listed, None)
        self._unused_watch = set()

    def _pod(self, pod: Obj) -> None:
        now, md = time.monotonic(), pod["metadata"]
        self.pod_seen.setdefault(md["name"], now)
        if md.get("deletionTimestamp"):
            self.deletion_seen.setdefault(md["name"], now)
        if pod.get("status", {}).get("phase") == "Running":
            self.running.setdefault(md["name"], now)

    def pods_left(self) -> bool:
        return len(self._pods.store) > 0

    def _va(self, va: Obj) -> None:
        self.va_gone.setdefault(va["metadata"]["name"], time.monotonic())


async def wait_until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s: {what}")
        await asyncio.sleep(0.05)


@dataclass
class PassTimes:
    """Per pod, seconds from its creation (mount side) or deletion (detach side)."""

    pod_seen: list[float]
    va_created: list[float]
    va_attached: list[float]
    node_listed: list[float]
    mount: list[float]
    mount_total: float
    deletion_seen: list[float]
    node_unused: list[float]
    va_deleting: list[float]
    detach: list[float]
    detach_total: float
    # CPU seconds each process of `pids` spent from the first pod's creation until all ran, and
    # from the first deletion until every VolumeAttachment was gone.
    mount_cpu: CpuUse
    detach_cpu: CpuUse


def pod_names(tag: str, volumes: list[tuple[str, str]]) -> dict[str, tuple[str, tuple[str, str]]]:
    """Pod name -> (its node, (claim, volume handle)): one pod per volume, half per node."""
    return {f"{tag}-{i}": (NODES[i % len(NODES)], vol) for i, vol in enumerate(volumes)}


async def create_pods(stack: StorageStack, names: dict[str, tuple[str, tuple[str, str]]]) -> dict[str, float]:
    """Creates the pods at once; returns when each was created."""
    created: dict[str, float] = {}

    async def create(name: str) -> None:
        node, (claim, _) = names[name]
        created[name] = time.monotonic()
        await stack.pod(NAMESPACE, name, node, claim)

    await asyncio.gather(*(create(n) for n in names))
    return created


async def run_pods(
    stack: StorageStack, clock: Clock, names: dict[str, tuple[str, tuple[str, str]]], timeout: float, tag: str
) -> dict[str, float]:
    """Creates the pods at once and waits until all run; returns when each was created."""
    created = await create_pods(stack, names)
    await wait_until(lambda: all(n in clock.running for n in names), timeout, f"{tag}: all pods running")
    return created


async def delete_pods(stack: StorageStack, names: Iterable[str]) -> dict[str, float]:
    """Deletes the pods at once; returns when each deletion was sent."""
    deleted: dict[str, float] = {}

    async def delete(name: str) -> None:
        deleted[name] = time.monotonic()
        await stack.api.delete(PODS, name, NAMESPACE)

    await asyncio.gather(*(delete(n) for n in names))
    return deleted


async def vas_gone(clock: Clock, vas: Mapping[str, str], timeout: float, tag: str) -> None:
    await wait_until(lambda: all(v in clock.va_gone for v in vas.values()), timeout, f"{tag}: all VAs gone")


async def clear_pass(
    stack: StorageStack, clock: Clock, names: dict[str, tuple[str, tuple[str, str]]], timeout: float, tag: str
) -> None:
    """The end of a pass whose detach is not measured: deletes its pods, waits until their
    VolumeAttachments and the pods are gone, and drops the pass's marks from the clock."""
    vas, unique = pass_volumes(names)
    await delete_pods(stack, names)
    await vas_gone(clock, vas, timeout, tag)
    await wait_until(lambda: not clock.pods_left(), timeout, f"{tag}: pods deleted")
    clock.forget({vas[n]: unique[n] for n in names})


def pass_volumes(
    names: dict[str, tuple[str, tuple[str, str]]],
) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """Per pod: its VolumeAttachment's name, and (node, unique volume name) as the node lists it."""
    vas = {n: va_name(handle, DRIVER_NAME, node) for n, (node, (_, handle)) in names.items()}
    unique = {n: (node, unique_volume_name(DRIVER_NAME, handle)) for n, (node, (_, handle)) in names.items()}
    return vas, unique


async def one_pass(
    stack: StorageStack,
    clock: Clock,
    volumes: list[tuple[str, str]],
    tag: str,
    timeout: float,
    pids: Callable[[], Mapping[str, int | None]] = dict,
) -> PassTimes:
    """Creates a pod per volume and waits until all run, then deletes them and waits until every
    VolumeAttachment is gone and every pod deleted; the CPU of the processes `pids` names is
    measured over both."""
    names = pod_names(tag, volumes)
    start = time.monotonic()
    with CpuUse(pids) as mount_cpu:
        created = await run_pods(stack, clock, names, timeout, tag)
    mount_total = max(clock.running[n] for n in names) - start
    mount = [clock.running[n] - created[n] for n in names]
    vas, unique = pass_volumes(names)

    def since_created(marks: dict[Any, float], keys: dict[str, Any]) -> list[float]:
        return [marks[keys[n]] - created[n] for n in names if keys[n] in marks]

    own = {n: n for n in names}
    stages = (
        since_created(clock.pod_seen, own),
        since_created(clock.va_created, vas),
        since_created(clock.va_attached, vas),
    )
    listed = since_created(clock.listed, unique)
    clock.watch_unused(set(unique.values()))
    start = time.monotonic()
    with CpuUse(pids) as detach_cpu:
        deleted = await delete_pods(stack, names)
        await vas_gone(clock, vas, timeout, tag)
    detach_total = max(clock.va_gone[v] for v in vas.values()) - start
    detach = [clock.va_gone[vas[n]] - deleted[n] for n in names]

    def since_deleted(marks: dict[Any, float], keys: dict[str, Any]) -> list[float]:
        return [marks[keys[n]] - deleted[n] for n in names if keys[n] in marks]

    detach_stages = (
        since_deleted(clock.deletion_seen, own),
        since_deleted(clock.unused, unique),
        since_deleted(clock.va_deleting, vas),
    )
    clock.forget({vas[n]: unique[n] for n in names})
    await wait_until(lambda: not clock.pods_left(), timeout, f"{tag}: pods deleted")
    return PassTimes(
        *stages, listed, mount, mount_total, *detach_stages, detach, detach_total, mount_cpu, detach_cpu
    )


async def run_side(
    stack: StorageStack,
    comps: list[Component],
    clock: Clock,
    volumes: list[tuple[str, str]],
    tag: str,
    timeout: float,
) -> Pass:
    group = ShortHomeComponents(stack.cp, comps, stack.home)
    await group.start()
    side_names = list(group.processes)
    try:
        # One pod first, unmeasured: kcm answers before its controllers run.
        await one_pass(stack, clock, volumes[:1], f"{tag}-warm", timeout)
        await asyncio.sleep(WARM_SETTLE_S)

        def side() -> dict[str, int | None]:
            return {n: p.pid for n, p in group.processes.items()}

        def every() -> dict[str, int | None]:
            return {**shared_pids(stack), **side()}

        work = WorkCounts(stack.cp)
        async with PeakRss(side) as rss:
            await work.start()
            t = await one_pass(stack, clock, volumes, tag, timeout, every)
            await work.stop()
        counted = work.figures(len(volumes))
    finally:
        await group.stop()
    return Pass(
        len(volumes),
        round(percentile(t.va_created, 50), 3),
        round(percentile(t.va_attached, 50), 3),
        round(percentile(t.node_listed, 50), 3),
        round(percentile(t.mount, 50), 3),
        round(percentile(t.mount, 99), 3),
        round(t.mount_total, 3),
        round(percentile(t.node_unused or [math.nan], 50), 3),
        round(percentile(t.va_deleting or [math.nan], 50), 3),
        round(percentile(t.detach, 50), 3),
        round(percentile(t.detach, 99), 3),
        round(t.detach_total, 3),
        rss.peaks,
        round(percentile(t.pod_seen or [math.nan], 50), 3),
        round(percentile(t.deletion_seen or [math.nan], 50), 3),
        *_shares(t.mount_cpu, side_names, list(stack.cp.processes)),
        *_shares(t.detach_cpu, side_names, list(stack.cp.processes)),
        {"mount": t.mount_cpu.spent, "detach": t.detach_cpu.spent},
        counted["api_requests_per_op"],
        counted["api_requests"],
        counted["api_server_ms"],
        counted["flow_control_wait_ms"],
        per_pod_ms(t.mount_cpu, len(volumes)),
        round(percentile(t.va_created, 99), 3),
        round(percentile(t.va_attached, 99), 3),
        round(percentile(t.pod_seen or [math.nan], 99), 3),
    )


def shared_pids(stack: StorageStack) -> dict[str, int | None]:
    """The processes both sides share: the control plane and the storage stack's components."""
    return {n: p.pid for n, p in {**stack.cp.processes, **stack.components.processes}.items()}


def per_pod_ms(cpu: CpuUse, pods: int) -> float:
    """Every measured process's CPU, per pod, in milliseconds."""
    return round(1000 * sum(cpu.spent.values()) / pods, 1)


async def pre_attached_pass(
    stack: StorageStack,
    comps: list[Component],
    clock: Clock,
    volumes: list[tuple[str, str]],
    tag: str,
    timeout: float,
) -> Pass:
    """The floor the shared parts set: the pods start while no attach-detach controller or
    attacher runs, every volume already attached and listed by its node. `comps` attach the
    volumes for pods made and deleted first (unmeasured), stop, and detach them again once the
    measured pods are deleted. Only the mount figures, their CPU and the API requests apply."""
    holders = pod_names(f"{tag}-hold", volumes)
    _, unique = pass_volumes(holders)
    group = ShortHomeComponents(stack.cp, comps, stack.home)
    await group.start()
    try:
        await run_pods(stack, clock, holders, timeout, f"{tag}-hold")
    finally:
        await group.stop()
    # Only once no node reports a volume in use is every volume unmounted and unstaged.
    clock.watch_unused(set(unique.values()))
    await delete_pods(stack, holders)
    await wait_until(
        lambda: not clock.pods_left() and all(u in clock.unused for u in unique.values()),
        timeout,
        f"{tag}: holder pods deleted, volumes unstaged",
    )
    names = pod_names(tag, volumes)
    work = WorkCounts(stack.cp)
    await work.start()
    start = time.monotonic()
    with CpuUse(lambda: shared_pids(stack)) as cpu:
        created = await run_pods(stack, clock, names, timeout, tag)
    await work.stop()
    mount = [clock.running[n] - created[n] for n in names]
    mount_total = max(clock.running[n] for n in names) - start
    group = ShortHomeComponents(stack.cp, comps, stack.home)
    await group.start()
    try:
        await clear_pass(stack, clock, names, timeout, tag)
    finally:
        await group.stop()
    counted = work.figures(len(volumes))
    seen = [clock.pod_seen[n] - created[n] for n in names]
    _, node_cpu, server_cpu = _shares(cpu, [], list(stack.cp.processes))
    # The stages the pass skips, and its detach, are not this pass's figures.
    return Pass.partial(
        len(volumes),
        mount_p50_s=round(percentile(mount, 50), 3),
        mount_p99_s=round(percentile(mount, 99), 3),
        mount_total_s=round(mount_total, 3),
        pod_seen_p50_s=round(percentile(seen, 50), 3),
        pod_seen_p99_s=round(percentile(seen, 99), 3),
        mount_side_cpu_s=0.0,
        mount_node_cpu_s=node_cpu,
        mount_server_cpu_s=server_cpu,
        cpu_s={"mount": cpu.spent},
        api_requests_per_op=counted["api_requests_per_op"],
        api_requests=counted["api_requests"],
        api_server_ms=counted["api_server_ms"],
        flow_control_wait_ms=counted["flow_control_wait_ms"],
        mount_cpu_per_pod_ms=per_pod_ms(cpu, len(volumes)),
    )


async def created_first(
    stack: StorageStack,
    clock: Clock,
    names: dict[str, tuple[str, tuple[str, str]]],
    downstream: list[Component],
    timeout: float,
    tag: str,
) -> tuple[list[float], list[float]]:
    """Creates the pods and waits until every one's VolumeAttachment exists; only then starts
    `downstream`, which attaches them, so that the pods run; then deletes them and waits until
    every VolumeAttachment and pod is gone. Returns, per pod, when the bench's watch saw it and
    when its VolumeAttachment appeared, in seconds from its creation."""
    vas, _ = pass_volumes(names)
    created = await create_pods(stack, names)
    # The pods and the VolumeAttachments come on two watches: a VA may be seen before its pod.
    await wait_until(
        lambda: all(v in clock.va_created for v in vas.values()) and all(n in clock.pod_seen for n in names),
        timeout,
        f"{tag}: all pods seen and their VAs created",
    )
    seen = [clock.pod_seen[n] - created[n] for n in names]
    made = [clock.va_created[vas[n]] - created[n] for n in names]
    group = ShortHomeComponents(stack.cp, downstream, stack.home)
    await group.start()
    try:
        await wait_until(lambda: all(n in clock.running for n in names), timeout, f"{tag}: all pods running")
        await clear_pass(stack, clock, names, timeout, tag)
    finally:
        await group.stop()
    return seen, made


async def creation_pass(
    stack: StorageStack,
    comps: list[Component],
    controller: str,
    clock: Clock,
    volumes: list[tuple[str, str]],
    tag: str,
    timeout: float,
) -> Pass:
    """The first stage alone: `controller` (the side's attach-detach controller, one of `comps`)
    runs by itself until every pod's VolumeAttachment exists, and the rest of `comps` start only
    then. Only the figures of pod and VolumeAttachment creation apply."""
    alone = [c for c in comps if c.name == controller]
    if len(alone) != 1:
        raise ValueError(f"{controller!r} is not one of the side's components {[c.name for c in comps]}")
    downstream = [c for c in comps if c.name != controller]
    group = ShortHomeComponents(stack.cp, alone, stack.home)
    await group.start()
    try:
        # One pod first, unmeasured, as before a full pass.
        warm = f"{tag}-warm"
        await created_first(stack, clock, pod_names(warm, volumes[:1]), downstream, timeout, warm)
        await asyncio.sleep(WARM_SETTLE_S)
        seen, made = await created_first(stack, clock, pod_names(tag, volumes), downstream, timeout, tag)
    finally:
        await group.stop()
    return Pass.partial(
        len(volumes),
        pod_seen_p50_s=round(percentile(seen, 50), 3),
        pod_seen_p99_s=round(percentile(seen, 99), 3),
        va_created_p50_s=round(percentile(made, 50), 3),
        va_created_p99_s=round(percentile(made, 99), 3),
    )


def _shares(cpu: CpuUse, side: list[str], servers: list[str]) -> tuple[float, float, float]:
    """A phase's CPU seconds: the side's controllers, the shared node side, apiserver + etcd."""
    node = [n for n in cpu.spent if n.startswith(NODE_SIDE)]
    return cpu.total(side), cpu.total(node), cpu.total(servers)


BENCH = method.Bench(
    name="attach",
    title="pod creation -> Running with its volume attached and mounted, pod deletion -> "
    "VolumeAttachment gone (seconds)",
    sides={"kubeloop": "kubeloop", "go": "kcm + csi-attacher"},
    figures=(
        method.Figure("pod_seen_p50_s", "pod created p50 s"),
        method.Figure("pod_seen_p99_s", "pod created p99 s"),
        method.Figure("va_created_p50_s", "VA created p50 s"),
        method.Figure("va_created_p99_s", "VA created p99 s"),
        method.Figure("va_attached_p50_s", "VA attached p50 s"),
        method.Figure("va_attached_p99_s", "VA attached p99 s"),
        method.Figure("node_listed_p50_s", "node lists it p50 s"),
        method.Figure("mount_p50_s", "mount p50 s"),
        method.Figure("mount_p99_s", "mount p99 s"),
        method.Figure("mount_total_s", "mount all s"),
        method.Figure("deletion_seen_p50_s", "pod deleting p50 s"),
        method.Figure("node_unused_p50_s", "node unused p50 s"),
        method.Figure("va_deleting_p50_s", "VA deleting p50 s"),
        method.Figure("detach_p50_s", "detach p50 s"),
        method.Figure("detach_p99_s", "detach p99 s"),
        method.Figure("detach_total_s", "detach all s"),
        method.Figure("mount_side_cpu_s", "mount: side's CPU s"),
        method.Figure("mount_node_cpu_s", "mount: node side CPU s"),
        method.Figure("mount_server_cpu_s", "mount: apiserver+etcd CPU s"),
        method.Figure("detach_side_cpu_s", "detach: side's CPU s"),
        method.Figure("detach_node_cpu_s", "detach: node side CPU s"),
        method.Figure("detach_server_cpu_s", "detach: apiserver+etcd CPU s"),
        method.Figure("api_requests_per_op", "API requests per pod"),
        method.Figure("mount_cpu_per_pod_ms", "mount: all CPU per pod ms"),
    ),
)


# Scenario name -> its label; with --isolate the two after "default" run too, each with one
# kubeloop controller, with --floor the pre-attached one and with --creation the last one.
SCENARIOS = {
    "default": "default",
    "attach-detach-controller": "kubeloop's attach-detach controller + csi-attacher",
    "external-attacher": "kcm + kubeloop's external-attacher",
    PRE_ATTACHED: "pre-attached: kubeloop column no attach work at all (the floor), go column Go's pass",
    CREATION: "creation alone: each side's attach-detach controller by itself until every VA exists",
}


def scenario_names(isolate: bool, floor: bool, creation: bool) -> list[str]:
    """The scenarios a run measures, in SCENARIOS' order."""
    wanted = {"default"} | ({*GO_COUNTERPART} if isolate else set())
    wanted |= {n for n, chosen in ((PRE_ATTACHED, floor), (CREATION, creation)) if chosen}
    return [n for n in SCENARIOS if n in wanted]


def isolating(kubeloop: list[Component], go: list[Component], own: str) -> list[Component]:
    """Go's side with kubeloop's controller `own` (a component name) in place of its counterpart."""
    mine = next(c for c in kubeloop if c.name == own)
    return [mine if c.name == GO_COUNTERPART[own] else c for c in go]


def side_components(ses: Session, qps: float, burst: int) -> dict[str, list[Component]]:
    """What each side runs over a session's shared stack (bench.attach, bench.scaling)."""
    return {
        "kubeloop": kubeloop_side(qps, burst),
        "go": go_side(qps, burst, str(ses.stack.cp.admin_kubeconfig)),
    }


async def collect(args: argparse.Namespace) -> dict[str, list[method.Pair]]:
    async with session(args.pods, args.qps, args.burst, args.timeout) as ses:
        sides = side_components(ses, args.qps, args.burst)

        async def one(scenario: str, side: str, r: int) -> Pass:
            comps, tag = sides[side], f"r{r}-{side}"
            if scenario != "default":
                tag = f"r{r}-{scenario}-{side}"  # pod names `<tag>-<i>` stay far under 63 characters
                if scenario == CREATION:
                    own = "attach-detach-controller"
                    controller = own if side == "kubeloop" else GO_COUNTERPART[own]
                    return await creation_pass(
                        ses.stack, comps, controller, ses.clock, ses.volumes, tag, args.timeout
                    )
                if side == "kubeloop" and scenario == PRE_ATTACHED:
                    return await pre_attached_pass(
                        ses.stack, comps, ses.clock, ses.volumes, tag, args.timeout
                    )
                if side == "kubeloop":
                    comps = isolating(sides["kubeloop"], sides["go"], scenario)
            return await run_side(ses.stack, comps, ses.clock, ses.volumes, tag, args.timeout)

        names = scenario_names(args.isolate, args.floor, args.creation)
        return await method.alternate_scenarios({n: SCENARIOS[n] for n in names}, args.rounds, one)


def common_components(pods: int) -> list[Component]:
    """The shared part of the stack. A pass that puts more volumes on a node than a node plugin
    accepts by default (attach at 1,000 pods over 2 nodes) gets node plugins that take them all:
    pods here name their node, so nothing would keep them off a full one."""
    comps = storage_components(COMMON)
    per_node = -(-pods // len(NODES))
    if per_node <= MAX_VOLUMES_PER_NODE:
        return comps

    def taking_all(comp: Component) -> Component:
        base = comp.argv
        return dataclasses.replace(comp, argv=lambda c: [*base(c), f"--max-volumes-per-node={per_node}"])

    return [taking_all(c) if c.name == "csi-driver-node" else c for c in comps]


@dataclass
class Session:
    stack: StorageStack
    clock: Clock
    volumes: list[tuple[str, str]]  # (claim, volume handle)


@contextlib.asynccontextmanager
async def session(pods: int, qps: float, burst: int, timeout: float) -> AsyncIterator[Session]:
    """A control plane with the shared part of the stack, N formatted volumes pre-bound to N
    claims and the clock watching pods and VolumeAttachments (bench.attach, bench.profile)."""
    async with control_plane(with_kcm=False, with_scheduler=False) as cp:
        api = await ApiClient.from_kubeconfig(str(cp.admin_kubeconfig), qps=0, burst=1, user_agent="bench")
        stack = StorageStack(cp, api, components=common_components(pods))
        try:
            volumes = await prepare(stack, api, pods)
            informers = (
                SharedInformer(api, PODS, namespace=NAMESPACE),
                SharedInformer(api, VOLUME_ATTACHMENTS),
                SharedInformer(api, NODE_OBJECTS),
            )
            clock = Clock(*informers)
            for informer in informers:
                informer.start()
            try:
                await asyncio.gather(*(i.wait_for_sync() for i in informers))
                print("formatting every volume once (unmeasured pass) ...", flush=True)
                await run_side(stack, kubeloop_side(qps, burst), clock, volumes, "format", timeout)
                yield Session(stack, clock, volumes)
            finally:
                for informer in informers:
                    await informer.stop()
        finally:
            await stack.stop()
            await api.close()


async def prepare(stack: StorageStack, api: ApiClient, n: int) -> list[tuple[str, str]]:
    """Starts the shared part of the stack and makes the namespace and N static volumes pre-bound
    to N claims; returns (claim, volume handle) pairs."""
    await stack.start()
    await api.create(NAMESPACES, {"metadata": {"name": NAMESPACE}})
    # No kcm here (the Go side runs only its attach-detach controller): nobody else would
    # create the namespace's default ServiceAccount that pod admission requires.
    sa = Resource("", "v1", "serviceaccounts", "ServiceAccount", True)
    await api.create(sa, {"metadata": {"name": "default", "namespace": NAMESPACE}})
    print(f"creating {n} volumes, static PVs and claims ...", flush=True)
    volumes: list[tuple[str, str]] = []
    for chunk in range(0, n, 20):
        made = await asyncio.gather(
            *(stack.volume(NAMESPACE, size_mi=16) for _ in range(chunk, min(n, chunk + 20)))
        )
        volumes.extend((pvc, handle) for pvc, _pv, handle in made)
    return volumes


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.attach", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pods",
        type=int,
        default=PODS_DEFAULT,
        help=f"pods, each with its own claim (default: {PODS_DEFAULT})",
    )
    method.add_rounds_arg(parser)
    parser.add_argument(
        "--qps", type=float, default=50.0, help="client QPS of both sides' controllers (default: 50)"
    )
    parser.add_argument("--burst", type=int, default=100, help="client burst of both sides (default: 100)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per pass (default: 600s)")
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="also run each of kubeloop's two controllers beside the other's Go counterpart",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also start the pods with every volume attached and listed beforehand and no "
        "controller running: the mount time and CPU per pod that the shared parts alone set",
    )
    parser.add_argument(
        "--creation",
        action="store_true",
        help="also run each side's attach-detach controller alone until every VolumeAttachment "
        "exists, its attacher started only then: the first stage with no attacher at work",
    )
    args = parser.parse_args()
    params = {"pods": args.pods, "nodes": len(NODES), "QPS/burst": f"{args.qps:g}/{args.burst}"}
    method.run(BENCH, params, lambda: collect(args))


if __name__ == "__main__":
    main()
