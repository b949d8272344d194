"""The chaos campaign: a steady storage workload on the local stack while its processes are killed,
the control plane restarted, controllers paused past their lease and the pool filled; after each
round the system is left to settle and the invariants of docs/chaos.md are checked.

The stack is the real one: the session's etcd, kube-apiserver and kube-controller-manager, and
every kubeloop component of the `make up` registry as its own supervised process (restarted with
backoff after a crash, as `make up` does), the controllers with leader election on short leases.
Volumes are sparse files in the pool attached as real loop devices and mounted by the node agents.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import random
import signal
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.resources import (
    EVENTS,
    LEASES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    VOLUME_ATTACHMENTS,
    Obj,
)
from csi_driver import DRIVER_NAME
from localstack.components import REGISTRY, Component, ComponentContext
from localstack.controlplane import ControlPlane
from localstack.proc import ManagedProcess, RestartPolicy, free_ports
from localstack.storage_stack import NODES, StorageStack, loop_backing_files, mounts_under, storage_components
from tests.support.waits import WaitFailed, eventually_async, no_problems

T = TypeVar("T")
PVCS = PERSISTENT_VOLUME_CLAIMS

# Every kubeloop process kind of `make up`; the per-node ones run once per node.
KINDS = tuple(c.name for c in REGISTRY)
# The controllers that run under a leader-election Lease: a pause longer than the lease costs
# them their leadership, and they must give up and come back cleanly.
LEADER_ELECTED = (
    "pv-controller",
    "external-provisioner",
    "external-attacher",
    "attach-detach-controller",
    "volume-expand-controller",
    "external-resizer",
)
LEASE_SECONDS = 4.0
# Short restarts: a campaign kills hundreds of times and must not spend them in backoff; the
# series and its reset are those of `make up`, only scaled down.
CHAOS_RESTART = RestartPolicy(initial=0.5, factor=2.0, cap=4.0, reset_after=20.0)
POOL_CAPACITY_MI = 1024
CLAIM_MI = 16
EXPANDED_MI = 32
FILL_MI = 384
OP_TIMEOUT = 240.0


@dataclass
class ChaosConfig:
    rounds: int = 3
    kills_per_round: int = 3
    # Every n-th round (counting from 1) restarts the apiserver, restarts etcd, pauses a
    # controller past its lease, fills the pool; 0 never.
    apiserver_every: int = 2
    etcd_every: int = 3
    pause_every: int = 2
    fill_every: int = 3
    claims_per_round: int = 2
    # Replicas of each leader-elected controller; with 2, every `leader_kill_every`-th round
    # kills the Lease holder of one of them and times the standby's takeover.
    replicas: int = 1
    leader_kill_every: int = 0
    settle_timeout: float = 180.0
    seed: int = 0
    report_path: Path | None = None


@dataclass
class RoundFigures:
    round: int
    kills: Counter[str] = field(default_factory=Counter)
    apiserver_restarts: int = 0
    etcd_restarts: int = 0
    pauses: Counter[str] = field(default_factory=Counter)
    operations: Counter[str] = field(default_factory=Counter)
    invariant_checks: int = 0
    leaked: Counter[str] = field(default_factory=Counter)  # files, devices, mounts, finalizers, attachments
    corruptions: int = 0
    double_attachments: int = 0
    refused_claims: int = 0
    takeovers: dict[str, float] = field(default_factory=dict)  # kind: seconds until the standby led
    settle_seconds: float = 0.0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        kills = ", ".join(f"{k} {n}" for k, n in sorted(self.kills.items())) or "none"
        ops = sum(self.operations.values())
        leaks = sum(self.leaked.values())
        return (
            f"round {self.round}: {sum(self.kills.values())} kills ({kills}); apiserver restarts "
            f"{self.apiserver_restarts}, etcd restarts {self.etcd_restarts}, "
            f"pauses {sum(self.pauses.values())}; "
            f"{ops} operations; {self.invariant_checks} invariant checks passed; leaks {leaks} "
            f"{dict(self.leaked)}; corruptions {self.corruptions}; double attachments "
            f"{self.double_attachments}; refused claims {self.refused_claims}; leader takeovers "
            f"{ {k: round(v, 1) for k, v in self.takeovers.items()} }; settled in "
            f"{self.settle_seconds:.1f}s; round {self.seconds:.0f}s; failures {len(self.failures)}"
        )


@dataclass
class Report:
    rounds: list[RoundFigures]
    seed: int

    def totals(self) -> dict[str, Any]:
        kills: Counter[str] = Counter()
        pauses: Counter[str] = Counter()
        ops: Counter[str] = Counter()
        leaked: Counter[str] = Counter()
        for r in self.rounds:
            kills.update(r.kills)
            pauses.update(r.pauses)
            ops.update(r.operations)
            leaked.update(r.leaked)
        settle = sorted(r.settle_seconds for r in self.rounds)
        return {
            "rounds": len(self.rounds),
            "seed": self.seed,
            "kills": sum(kills.values()),
            "kills_by_kind": dict(sorted(kills.items())),
            "apiserver_restarts": sum(r.apiserver_restarts for r in self.rounds),
            "etcd_restarts": sum(r.etcd_restarts for r in self.rounds),
            "pauses_by_kind": dict(sorted(pauses.items())),
            "operations": sum(ops.values()),
            "operations_by_kind": dict(sorted(ops.items())),
            "invariant_checks_passed": sum(r.invariant_checks for r in self.rounds),
            "leaked": {
                k: leaked.get(k, 0) for k in ("files", "devices", "mounts", "finalizers", "attachments")
            },
            "corruptions": sum(r.corruptions for r in self.rounds),
            "double_attachments": sum(r.double_attachments for r in self.rounds),
            "refused_claims": sum(r.refused_claims for r in self.rounds),
            "leader_takeovers": sum(len(r.takeovers) for r in self.rounds),
            "takeover_max": max((v for r in self.rounds for v in r.takeovers.values()), default=0.0),
            "settle_p50": _percentile(settle, 50),
            "settle_p99": _percentile(settle, 99),
            "seconds": sum(r.seconds for r in self.rounds),
            "failures": [f for r in self.rounds for f in r.failures],
        }

    def summary(self) -> str:
        t = self.totals()
        kinds = ", ".join(f"{k} {n}" for k, n in t["kills_by_kind"].items())
        return (
            f"chaos total: {t['rounds']} rounds, {t['kills']} kills ({kinds}); apiserver restarts "
            f"{t['apiserver_restarts']}, etcd restarts {t['etcd_restarts']}, pauses "
            f"{sum(t['pauses_by_kind'].values())}; {t['operations']} operations; "
            f"{t['invariant_checks_passed']} invariant checks passed; leaked {t['leaked']}; corruptions "
            f"{t['corruptions']}; double attachments {t['double_attachments']}; refused claims "
            f"{t['refused_claims']}; leader takeovers {t['leader_takeovers']} "
            f"(max {t['takeover_max']:.1f}s); "
            f"settle p50 {t['settle_p50']:.1f}s p99 {t['settle_p99']:.1f}s; "
            f"{t['seconds']:.0f}s; failures {len(t['failures'])}"
        )

    def write(self, path: Path) -> None:
        data = {"totals": self.totals(), "rounds": [_round_json(r) for r in self.rounds]}
        path.write_text(json.dumps(data, indent=2) + "\n")


def _round_json(r: RoundFigures) -> dict[str, Any]:
    out = dataclasses.asdict(r)
    for key in ("kills", "pauses", "operations", "leaked", "takeovers"):
        out[key] = dict(getattr(r, key))
    return out


def _percentile(values: list[float], pct: int) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[pct - 1] if pct < 100 else max(values)


# -- the stack ------------------------------------------------------------------------------------


def _with_args(comp: Component, *extra: str) -> Component:
    base = comp.argv

    def argv(c: ComponentContext) -> list[str]:
        return [*base(c), *extra]

    return dataclasses.replace(comp, argv=argv)


def chaos_components(replicas: int = 1) -> list[Component]:
    """The whole registry on free ports: a pool of bounded capacity (so it can be filled) and the
    controllers under leader election with a short lease (so a pause can outlast it), each in
    `replicas` copies (`<name>-standby<i>` after the first) competing for one Lease."""
    lease = (
        "--leader-election",
        # Where deploy/rbac lets them hold Leases (the sidecars' own default is the pod's namespace,
        # which a process of the local stack does not have).
        "--leader-election-namespace=kube-system",
        f"--leader-election-lease-duration={LEASE_SECONDS:g}s",
        f"--leader-election-renew-deadline={LEASE_SECONDS * 0.75:g}s",
        f"--leader-election-retry-period={LEASE_SECONDS / 4:g}s",
    )
    out = []
    for comp in storage_components(KINDS):
        if comp.name == "csi-driver-controller":
            comp = _with_args(comp, f"--capacity={POOL_CAPACITY_MI}Mi")
        elif comp.name in LEADER_ELECTED:
            comp = _with_args(comp, *lease)
        out.append(comp)
        if comp.name in LEADER_ELECTED:
            for i in range(1, replicas):
                standby = f"{comp.name}-standby{i}"
                out.append(dataclasses.replace(comp, name=standby, http_port=free_ports(1)[0], manifests=()))
    return out


def chaos_stack(cp: ControlPlane, api: ApiClient, replicas: int = 1) -> StorageStack:
    return StorageStack(cp, api, KINDS, restart=CHAOS_RESTART, components=chaos_components(replicas))


# -- helpers --------------------------------------------------------------------------------------

_TRANSIENT = (OSError,)  # the API client's transport errors and timeouts are OSErrors


class _Unavailable(Exception):
    """An ApiError the apiserver or etcd restarting answers with (5xx, 429): try again."""


async def _through_restarts(call: Callable[[], Awaitable[T]]) -> T:
    try:
        return await call()
    except ApiError as e:
        if e.status < 500 and e.status != 429:
            raise
        raise _Unavailable(str(e)) from e


_RETRIED = (_Unavailable, *_TRANSIENT)


async def retrying(call: Callable[[], Awaitable[T]], what: str, timeout: float = 120.0) -> T:
    """An API call through apiserver and etcd restarts: connection errors, 5xx and 429 are retried."""
    attempts = 0

    async def attempt() -> tuple[T]:
        nonlocal attempts
        attempts += 1
        try:
            return (await _through_restarts(call),)
        except ApiError as e:
            # A create or delete the apiserver did before its answer was lost is done: a retry
            # meets AlreadyExists or NotFound. Callers that need the object read it again.
            if attempts > 1 and (e.already_exists or e.not_found):
                return (e.body,)  # type: ignore[return-value]
            raise

    (result,) = await eventually_async(f"{what} (through restarts)", attempt, timeout, 0.5, ignoring=_RETRIED)
    return result


async def through_restarts(
    what: str, check: Callable[[], Awaitable[T | None]], timeout: float = OP_TIMEOUT
) -> T:
    """`eventually_async` for a check that reads the API while its apiserver and etcd restart."""
    return await eventually_async(what, lambda: _through_restarts(check), timeout, 0.25, ignoring=_RETRIED)


def checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_checked(directory: Path, name: str, rng: random.Random) -> str:
    """Writes random data (fsynced) and returns its checksum."""
    data = rng.randbytes(64 * 1024)
    with open(directory / name, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return checksum(data)


def read_checksum(path: Path) -> str | None:
    try:
        return checksum(path.read_bytes())
    except OSError:
        return None


def claim_body(name: str, namespace: str, size_mi: int) -> Obj:
    """A ReadWriteOnce claim of the default class `kubeloop` (Immediate: provisioned at once)."""
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "kubeloop",
            "resources": {"requests": {"storage": f"{size_mi}Mi"}},
        },
    }


def _pv_node(pv: Obj) -> str | None:
    terms = pv.get("spec", {}).get("nodeAffinity", {}).get("required", {}).get("nodeSelectorTerms", [])
    for term in terms:
        for expr in term.get("matchExpressions", []):
            if expr.get("values"):
                return str(expr["values"][0])
    return None


def _mi(quantity: str) -> int:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    for unit, factor in units.items():
        if quantity.endswith(unit):
            return int(float(quantity[: -len(unit)]) * factor)
    return int(quantity) >> 20


@dataclass
class Resident:
    """A movable (topology-free) volume whose pod lives across rounds, moved to the other node
    each round; its checksummed files must survive every round."""

    pvc: str
    pv: str
    handle: str
    node: str
    pod: str
    files: dict[str, str] = field(default_factory=dict)


# -- the campaign ---------------------------------------------------------------------------------


class Campaign:
    def __init__(
        self, cp: ControlPlane, api: ApiClient, stack: StorageStack, namespace: str, config: ChaosConfig
    ):
        self.cp = cp
        self.api = api
        self.stack = stack
        self.ns = namespace
        self.config = config
        self.rng = random.Random(config.seed)
        self.resident: Resident | None = None
        self._kind_order: list[str] = []
        self._deleting: set[str] = set()  # PV names whose deletion the workload started

    # -- workload --------------------------------------------------------------------------------

    async def setup(self) -> None:
        pvc, pv, handle = await self.stack.volume(self.ns, size_mi=64)
        self.resident = Resident(pvc, pv, handle, NODES[0], "")
        await self._resident_pod(NODES[0])
        mount = await self._mount_of(self.resident.pod, self.resident.node, pv)
        self.resident.files["r0.bin"] = write_checked(mount, "r0.bin", self.rng)

    async def _resident_pod(self, node: str, figures: RoundFigures | None = None) -> None:
        assert self.resident is not None
        name = f"resident-{uuid.uuid4().hex[:6]}"
        await retrying(lambda: self.stack.pod(self.ns, name, node, self.resident.pvc), "create resident pod")  # type: ignore[union-attr]
        self.resident.pod, self.resident.node = name, node
        await self._running(name, figures)

    async def _running(self, name: str, figures: RoundFigures | None = None) -> Obj:
        async def running() -> Obj | None:
            pod = await self.api.get(PODS, name, self.ns)
            return pod if pod.get("status", {}).get("phase") == "Running" else None

        try:
            pod: Obj = await through_restarts(f"pod {name} running", running)
        except AssertionError:
            # A filesystem the node plugin refuses to mount (fsck: UNEXPECTED INCONSISTENCY) is
            # data lost, the worst outcome: counted as a corruption, not only as a timeout.
            if figures is not None and await self._fs_inconsistent(name):
                figures.corruptions += 1
                figures.failures.append(f"pod {name}: its volume's filesystem is inconsistent (fsck refused)")
            raise
        return pod

    async def _fs_inconsistent(self, pod: str) -> bool:
        with contextlib.suppress(*_TRANSIENT, ApiError):
            events, _ = await self.api.list_all(EVENTS, self.ns)
            return any(
                e.get("involvedObject", {}).get("name") == pod
                and e.get("reason") == "FailedMount"
                and "INCONSISTENCY" in e.get("message", "")
                for e in events
            )
        return False

    async def _abandon(self, pods: list[str], claim: str) -> None:
        """After a failed operation: its pods and claim are deleted, so that what it leaves behind
        is judged by the invariants instead of blocking every later round."""
        for pod in pods:
            with contextlib.suppress(Exception):
                await self._delete_pod(pod)
        with contextlib.suppress(Exception):
            pvc = await retrying(functools.partial(self.api.get, PVCS, claim, self.ns), "get claim")
            if pvc.get("spec", {}).get("volumeName"):
                self._deleting.add(str(pvc["spec"]["volumeName"]))
            await retrying(functools.partial(self.api.delete, PVCS, claim, self.ns), "delete claim")

    async def _mount_of(self, pod_name: str, node: str, pv: str) -> Path:
        pod = await retrying(lambda: self.api.get(PODS, pod_name, self.ns), "get pod")
        return self.stack.mount_path(node, pod, pv)

    async def _delete_pod(self, name: str) -> None:
        with contextlib.suppress(ApiError):
            await retrying(lambda: self.api.delete(PODS, name, self.ns), f"delete pod {name}")

        async def gone() -> bool:
            try:
                await self.api.get(PODS, name, self.ns)
            except ApiError as e:
                if e.not_found:
                    return True
                raise
            return False

        await through_restarts(f"pod {name} gone", gone)

    async def move_resident(self, figures: RoundFigures) -> None:
        """Moves the resident pod to the other node and checks every file written so far."""
        r = self.resident
        assert r is not None
        target = NODES[1] if r.node == NODES[0] else NODES[0]
        await self._delete_pod(r.pod)
        figures.operations["pod deleted"] += 1
        await self._resident_pod(target, figures)
        figures.operations["pod moved"] += 1
        mount = await self._mount_of(r.pod, r.node, r.pv)
        for name, digest in r.files.items():
            figures.operations["file verified"] += 1
            if read_checksum(mount / name) != digest:
                figures.corruptions += 1
                figures.failures.append(f"resident file {name} does not read back intact on {r.node}")
        fname = f"r{figures.round}.bin"
        r.files[fname] = write_checked(mount, fname, self.rng)
        figures.operations["file written"] += 1

    async def claim_cycle(self, figures: RoundFigures, index: int) -> None:
        """A dynamic claim: provisioned, used by a pod, written, expanded, checked, released."""
        name = f"c{figures.round}-{index}-{uuid.uuid4().hex[:4]}"
        try:
            await self._claim_cycle(figures, name)
        except Exception:
            await self._abandon([f"p-{name}", f"q-{name}"], name)
            raise

    async def _claim_cycle(self, figures: RoundFigures, name: str) -> None:
        claim = claim_body(name, self.ns, CLAIM_MI)
        await retrying(lambda: self.api.create(PERSISTENT_VOLUME_CLAIMS, claim, self.ns), "create claim")
        figures.operations["claim created"] += 1

        async def bound() -> Obj | None:
            pvc = await self.api.get(PERSISTENT_VOLUME_CLAIMS, name, self.ns)
            return pvc if pvc.get("status", {}).get("phase") == "Bound" else None

        pvc = await through_restarts(f"claim {name} bound", bound)
        pv_name = str(pvc["spec"]["volumeName"])
        pv = await retrying(lambda: self.api.get(PERSISTENT_VOLUMES, pv_name), "get PV")
        node = _pv_node(pv) or NODES[0]
        pod_name = f"p-{name}"
        await retrying(lambda: self.stack.pod(self.ns, pod_name, node, name), "create pod")
        figures.operations["pod created"] += 1
        await self._running(pod_name, figures)
        mount = await self._mount_of(pod_name, node, pv_name)
        digest = write_checked(mount, "data.bin", self.rng)
        figures.operations["file written"] += 1

        patch = {"spec": {"resources": {"requests": {"storage": f"{EXPANDED_MI}Mi"}}}}
        await retrying(lambda: self.api.patch(PERSISTENT_VOLUME_CLAIMS, name, patch, self.ns), "expand claim")
        figures.operations["claim expanded"] += 1

        async def grown() -> bool:
            pv = await self.api.get(PERSISTENT_VOLUMES, pv_name)
            return _mi(str(pv["spec"]["capacity"]["storage"])) >= EXPANDED_MI

        await through_restarts(f"volume {pv_name} expanded to {EXPANDED_MI}Mi", grown)
        # The filesystem grows online only with CAP_SYS_RESOURCE; the pod is restarted either way,
        # which finishes the resize offline at the next stage and moves the pod's mount.
        await self._delete_pod(pod_name)
        figures.operations["pod deleted"] += 1
        pod_name = f"q-{name}"
        await retrying(lambda: self.stack.pod(self.ns, pod_name, node, name), "create pod")
        figures.operations["pod created"] += 1
        await self._running(pod_name, figures)
        mount = await self._mount_of(pod_name, node, pv_name)

        async def expanded() -> bool:
            pvc = await self.api.get(PERSISTENT_VOLUME_CLAIMS, name, self.ns)
            return _mi(str(pvc.get("status", {}).get("capacity", {}).get("storage", "0"))) >= EXPANDED_MI

        await through_restarts(f"claim {name} expanded to {EXPANDED_MI}Mi", expanded)
        figures.operations["file verified"] += 1
        if read_checksum(mount / "data.bin") != digest:
            figures.corruptions += 1
            figures.failures.append(f"claim {name}: data.bin changed across the expansion")
        await self._delete_pod(pod_name)
        figures.operations["pod deleted"] += 1
        self._deleting.add(pv_name)
        await retrying(lambda: self.api.delete(PERSISTENT_VOLUME_CLAIMS, name, self.ns), "delete claim")
        figures.operations["claim deleted"] += 1

    async def fill_pool(self, figures: RoundFigures) -> None:
        """Claims until the pool refuses one: the refused claim must stay Pending with a
        ProvisioningFailed event and no volume; then all of them are deleted."""
        names: list[str] = []
        refused: set[str] = set()
        for i in range(POOL_CAPACITY_MI // FILL_MI + 2):
            name = f"fill{figures.round}-{i}"
            claim = claim_body(name, self.ns, FILL_MI)
            await retrying(functools.partial(self.api.create, PVCS, claim, self.ns), "create claim")
            figures.operations["claim created"] += 1
            names.append(name)

            async def outcome(name: str = name) -> str | None:
                pvc = await self.api.get(PERSISTENT_VOLUME_CLAIMS, name, self.ns)
                if pvc.get("status", {}).get("phase") == "Bound":
                    return "bound"
                events, _ = await self.api.list_all(EVENTS, self.ns)
                for e in events:
                    if (
                        e.get("involvedObject", {}).get("name") == name
                        and e.get("reason") == "ProvisioningFailed"
                    ):
                        return "refused"
                return None

            if await through_restarts(f"fill claim {name} bound or refused", outcome) == "refused":
                refused.add(name)
                break
        figures.refused_claims += len(refused)
        if not refused:
            figures.failures.append(f"the pool ({POOL_CAPACITY_MI}Mi) never refused a claim")
        for name in refused:
            pvc = await retrying(functools.partial(self.api.get, PVCS, name, self.ns), "get claim")
            if pvc.get("spec", {}).get("volumeName"):
                # A refusal that still left a volume behind is not clean (it may bind later).
                figures.failures.append(f"refused claim {name} got volume {pvc['spec']['volumeName']}")
        for name in names:
            pvc = await retrying(functools.partial(self.api.get, PVCS, name, self.ns), "get claim")
            if pvc.get("spec", {}).get("volumeName"):
                self._deleting.add(str(pvc["spec"]["volumeName"]))
            await retrying(functools.partial(self.api.delete, PVCS, name, self.ns), "delete claim")
            figures.operations["claim deleted"] += 1

    # -- disruptions -----------------------------------------------------------------------------

    def _next_kind(self) -> str:
        """Kinds in shuffled passes, so a campaign kills each kind about as often as the others."""
        if not self._kind_order:
            self._kind_order = list(KINDS)
            self.rng.shuffle(self._kind_order)
        return self._kind_order.pop()

    def _replicas(self, kind: str) -> list[ManagedProcess]:
        """The processes of a kind: its node instances, or the controller and its standbys."""
        procs = self.stack.components.processes
        return [p for name, p in sorted(procs.items()) if name == kind or name.startswith(f"{kind}-")]

    def _instance(self, kind: str) -> ManagedProcess:
        return self.rng.choice(self._replicas(kind))

    async def _wait_up(self, proc: ManagedProcess) -> int:
        async def up() -> int | None:
            return proc.pid if proc.running else None

        pid: int = await through_restarts(f"{proc.name} running again", up, 60)
        return pid

    async def kill(self, figures: RoundFigures) -> None:
        kind = self._next_kind()
        proc = self._instance(kind)
        pid = await self._wait_up(proc)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        figures.kills[kind] += 1

    async def pause(self, figures: RoundFigures) -> None:
        """SIGSTOP a controller while it holds its lease, past the lease's expiry, then SIGCONT."""
        kind = self.rng.choice(LEADER_ELECTED)
        proc = self._instance(kind)
        pid = await self._wait_up(proc)
        os.killpg(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(LEASE_SECONDS * 1.5 + 1)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)
        figures.pauses[kind] += 1

    async def _lease_holders(self) -> dict[int, Obj]:
        """Lease by the pid its holder identity (`<host>_<pid>`) names."""
        leases, _ = await self.api.list_all(LEASES, "kube-system")
        out = {}
        for lease in leases:
            holder = str(lease.get("spec", {}).get("holderIdentity") or "")
            _, _, pid = holder.rpartition("_")
            if pid.isdigit():
                out[int(pid)] = lease
        return out

    async def kill_leader(self, figures: RoundFigures) -> None:
        """kill -9 of the Lease holder among a controller's replicas; the standby must take over
        within the lease duration (plus a retry period and the machine's slack)."""
        kind = self.rng.choice(LEADER_ELECTED)
        replicas = self._replicas(kind)

        async def leader() -> tuple[ManagedProcess, Obj] | None:
            holders = await self._lease_holders()
            for proc in replicas:
                if proc.running and proc.pid in holders:
                    return proc, holders[proc.pid]
            return None

        proc, lease = await through_restarts(f"a leader among {[p.name for p in replicas]}", leader, 60)
        assert proc.pid is not None
        name = lease["metadata"]["name"]
        killed_at = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        figures.kills[kind] += 1
        old = proc.pid

        async def taken_over() -> bool:
            holders = await self._lease_holders()
            return any(
                p.pid in holders and p.pid != old and holders[p.pid]["metadata"]["name"] == name
                for p in replicas
                if p.running
            )

        await through_restarts(f"a standby of {kind} holding Lease {name}", taken_over, LEASE_SECONDS * 6)
        figures.takeovers[kind] = time.monotonic() - killed_at
        if figures.takeovers[kind] > LEASE_SECONDS * 3:
            figures.failures.append(f"{kind}: the standby took {figures.takeovers[kind]:.1f}s to take over")

    async def disrupt(self, figures: RoundFigures) -> None:
        n = figures.round
        c = self.config
        for _ in range(c.kills_per_round):
            await asyncio.sleep(self.rng.uniform(0.5, 4.0))
            await self.kill(figures)
        if c.pause_every and n % c.pause_every == 0:
            await self.pause(figures)
        if c.replicas > 1 and c.leader_kill_every and n % c.leader_kill_every == 0:
            await self.kill_leader(figures)
        if c.apiserver_every and n % c.apiserver_every == 0:
            await asyncio.sleep(self.rng.uniform(0.5, 3.0))
            await self.cp.restart_apiserver()
            figures.apiserver_restarts += 1
        if c.etcd_every and n % c.etcd_every == 0:
            await asyncio.sleep(self.rng.uniform(0.5, 3.0))
            await self.cp.restart_etcd()
            figures.etcd_restarts += 1

    async def watch_attachments(self, figures: RoundFigures, stop: asyncio.Event) -> None:
        """Throughout the round: an RWO volume attached (status.attached) on two nodes at once."""
        seen: set[str] = set()
        while not stop.is_set():
            with contextlib.suppress(*_TRANSIENT, ApiError):
                for pv in await self._double_attached():
                    if pv not in seen:
                        seen.add(pv)
                        figures.double_attachments += 1
                        figures.failures.append(f"RWO volume {pv} attached on two nodes at once")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def _double_attached(self) -> list[str]:
        vas, _ = await self.api.list_all(VOLUME_ATTACHMENTS)
        pvs, _ = await self.api.list_all(PERSISTENT_VOLUMES)
        rwo = {p["metadata"]["name"] for p in pvs if p["spec"].get("accessModes") == ["ReadWriteOnce"]}
        nodes: dict[str, set[str]] = {}
        for va in vas:
            pv = va["spec"].get("source", {}).get("persistentVolumeName")
            if pv in rwo and va.get("status", {}).get("attached"):
                nodes.setdefault(pv, set()).add(va["spec"]["nodeName"])
        return [pv for pv, n in nodes.items() if len(n) > 1]

    # -- invariants ------------------------------------------------------------------------------

    async def check_invariants(self) -> tuple[dict[str, list[str]], Counter[str]]:
        """Every invariant's violations (empty list: it holds) and the leak counts."""
        api = self.api
        pvs, _ = await api.list_all(PERSISTENT_VOLUMES)
        pvcs, _ = await api.list_all(PERSISTENT_VOLUME_CLAIMS, self.ns)
        pods, _ = await api.list_all(PODS, self.ns)
        vas, _ = await api.list_all(VOLUME_ATTACHMENTS)
        ours = {
            p["metadata"]["name"]: p for p in pvs if p["spec"].get("csi", {}).get("driver") == DRIVER_NAME
        }
        handle_of = {name: str(p["spec"]["csi"]["volumeHandle"]) for name, p in ours.items()}
        leaked: Counter[str] = Counter()
        out: dict[str, list[str]] = {}

        # Backing files == the PVs of our driver.
        volumes_dir = self.stack.pool / "volumes"
        files = {p.stem for p in volumes_dir.glob("*.img")} if volumes_dir.exists() else set()
        handles = set(handle_of.values())
        leaked["files"] = len(files - handles)
        out["backing files == PVs"] = [f"file without PV: {h}" for h in sorted(files - handles)] + [
            f"PV without file: {h}" for h in sorted(handles - files)
        ]

        # What the pods use: claim -> PV -> handle, on the pod's node.
        claim_pv = {c["metadata"]["name"]: c["spec"].get("volumeName") for c in pvcs}
        in_use: set[tuple[str, str, str]] = set()  # (node, pv, pod uid)
        for pod in pods:
            node = pod["spec"].get("nodeName")
            for vol in pod["spec"].get("volumes", []):
                pv = claim_pv.get(vol.get("persistentVolumeClaim", {}).get("claimName"))
                if node and pv:
                    in_use.add((node, pv, pod["metadata"]["uid"]))

        # Loop devices == staged volumes (each volume a pod uses is staged once per node).
        pool = str(volumes_dir) + "/"
        devices = Counter(Path(back).stem for _dev, back in loop_backing_files() if back.startswith(pool))
        staged = Counter(handle_of[pv] for _node, pv in {(n, p) for n, p, _ in in_use} if pv in handle_of)
        extra_devices = devices - staged
        leaked["devices"] = sum(extra_devices.values())
        out["loop devices == staged volumes"] = [
            f"loop device for {h} x{n}" for h, n in extra_devices.items()
        ] + [f"no loop device for staged {h}" for h in staged if h not in devices]

        # Mounts == running pods' volumes (their target and the node's staging mount).
        expected: set[str] = set()
        for node, pv, uid in in_use:
            root = self.stack.kubelet_root(node)
            expected.add(str(root / "pods" / uid / "volumes" / "kubernetes.io~csi" / pv / "mount"))
            digest = hashlib.sha256(handle_of.get(pv, "").encode()).hexdigest()
            expected.add(
                str(root / "plugins" / "kubernetes.io" / "csi" / DRIVER_NAME / digest / "globalmount")
            )
        mounts = set(mounts_under(self.stack.home))
        leaked["mounts"] = len(mounts - expected)
        out["mounts == pods' volumes"] = [f"leaked mount {m}" for m in sorted(mounts - expected)] + [
            f"missing mount {m}" for m in sorted(expected - mounts)
        ]

        # No VolumeAttachment for an RWO volume attached elsewhere; none without a pod on its node.
        by_pv: dict[str, list[str]] = {}
        for va in vas:
            pv = va["spec"].get("source", {}).get("persistentVolumeName")
            if pv in ours:
                by_pv.setdefault(pv, []).append(va["spec"]["nodeName"])
        wanted = {(n, p) for n, p, _ in in_use}
        problems = []
        for pv, nodes in by_pv.items():
            if ours[pv]["spec"].get("accessModes") == ["ReadWriteOnce"] and len(nodes) > 1:
                problems.append(f"RWO volume {pv} has VolumeAttachments on {sorted(nodes)}")
            for n in nodes:
                if (n, pv) not in wanted:
                    leaked["attachments"] += 1
                    problems.append(f"VolumeAttachment of {pv} on {n} without a pod there")
        out["no VolumeAttachment for a volume attached elsewhere"] = problems

        # No finalizer left on a deleted object.
        stuck = [
            f"{kind} {o['metadata']['name']} deleted at {o['metadata']['deletionTimestamp']} still has "
            f"finalizers {o['metadata'].get('finalizers')}"
            for kind, objs in (("pvc", pvcs), ("pv", pvs), ("pod", pods), ("va", vas))
            for o in objs
            if o["metadata"].get("deletionTimestamp")
        ]
        leaked["finalizers"] = len(stuck)
        out["no finalizer left on a deleted object"] = stuck

        # Every claim Bound (the refused ones were deleted by the filler); PVs the workload
        # released are gone (reclaim Delete).
        out["every claim Bound"] = [
            f"claim {c['metadata']['name']} is {c.get('status', {}).get('phase')}"
            for c in pvcs
            if c.get("status", {}).get("phase") != "Bound"
        ]
        # No double action: one PV per claim (provisioned once).
        per_claim = Counter(
            p["spec"]["claimRef"]["uid"] for p in ours.values() if p["spec"].get("claimRef", {}).get("uid")
        )
        out["one PV per claim"] = [f"claim uid {u} has {n} PVs" for u, n in per_claim.items() if n > 1]
        out["released PVs deleted"] = [f"PV {pv} still exists" for pv in sorted(self._deleting & set(ours))]
        return out, leaked

    async def settle(self, figures: RoundFigures) -> None:
        started = time.monotonic()
        seen: dict[str, tuple[dict[str, list[str]], Counter[str]]] = {}

        async def invariants() -> dict[str, list[str]]:
            try:
                seen["last"] = await self.check_invariants()
            except (*_TRANSIENT, ApiError) as e:
                seen["last"] = {"API reachable": [str(e)]}, Counter()
            result = seen["last"][0]
            return {k: v for k, v in result.items() if v}

        try:
            await eventually_async(
                "the invariants", invariants, self.config.settle_timeout, 0.5, satisfied=no_problems
            )
        except WaitFailed:
            result, leaked = seen["last"]
            failing = {k: v for k, v in result.items() if v}
            figures.settle_seconds = time.monotonic() - started
            figures.invariant_checks += len(result) - len(failing)
            figures.leaked.update(leaked)
            for k, v in failing.items():
                figures.failures.append(f"after {self.config.settle_timeout:.0f}s: {k}: {'; '.join(v[:5])}")
            return
        figures.settle_seconds = time.monotonic() - started
        figures.invariant_checks += len(seen["last"][0])
        # Checksums, checked here again after everything settled.
        await self.verify_resident(figures)

    async def verify_resident(self, figures: RoundFigures) -> None:
        r = self.resident
        assert r is not None
        mount = await self._mount_of(r.pod, r.node, r.pv)
        for name, digest in r.files.items():
            if read_checksum(mount / name) != digest:
                figures.corruptions += 1
                figures.failures.append(f"resident file {name} does not read back intact after settling")
        figures.invariant_checks += 1

    # -- rounds ----------------------------------------------------------------------------------

    async def round(self, n: int) -> RoundFigures:
        figures = RoundFigures(n)
        started = time.monotonic()
        stop = asyncio.Event()
        monitor = asyncio.create_task(self.watch_attachments(figures, stop))
        work: list[Awaitable[None]] = [self.move_resident(figures)]
        work += [self.claim_cycle(figures, i) for i in range(self.config.claims_per_round)]
        if self.config.fill_every and n % self.config.fill_every == 0:
            work.append(self.fill_pool(figures))
        work.append(self.disrupt(figures))
        results = await asyncio.gather(*work, return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                figures.failures.append(f"{type(res).__name__}: {res}")
        await self.settle(figures)
        stop.set()
        await monitor
        figures.seconds = time.monotonic() - started
        return figures

    async def run(
        self, on_round: Callable[[RoundFigures], None] = lambda r: print(r.line(), flush=True)
    ) -> Report:
        await self.setup()
        report = Report([], self.config.seed)
        for n in range(1, self.config.rounds + 1):
            figures = await self.round(n)
            report.rounds.append(figures)
            on_round(figures)
            if self.config.report_path is not None:
                report.write(self.config.report_path)
        return report


async def run_campaign(cp: ControlPlane, api: ApiClient, namespace: str, config: ChaosConfig) -> Report:
    stack = chaos_stack(cp, api, config.replicas)
    try:
        await stack.start()
        return await Campaign(cp, api, stack, namespace, config).run()
    finally:
        await stack.stop()


__all__ = ["KINDS", "Campaign", "ChaosConfig", "Report", "RoundFigures", "chaos_stack", "run_campaign"]
