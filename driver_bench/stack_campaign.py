"""The fault campaign through the whole local stack (issue 48; docs/driver-bench.md, "The stack
campaign"): where `campaign` plays the sidecars itself, this one runs `make up DRIVER=recipe` with
the bench's fault proxy in front of each plugin's socket (`--driver-fault`,
driver_bench/stack_plugin.py), so the calls are kubeloop's sidecars' and node agent's, retried as
they retry them, and the oracles are Kubernetes': the pod Running, the claim expanded, the snapshot
ready, the data read back by a pod on another node and from the restored claim, nothing stuck once
the claims are deleted (PVs, VolumeAttachments, snapshot contents, finalizers), the backend's
inventory against what the driver said it created and deleted, no mounts or loop devices left.

A scenario that found something runs again with upstream's Go sidecars in place of kubeloop's
(`--sidecars=go`): a finding seen again is the driver's; one that goes away is kubeloop's
sidecars' (the node agent, kubelet's part, is kubeloop's in both).

Each scenario runs a fresh stack on a fresh home: a reset between scenarios would have to undo
what a fault left (a stuck PV, a volume the backend leaked), which is what is being judged."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import psutil
import yaml

from controller_runtime.kinds import (
    KubeObject,
    PodStatus,
    VolumeSnapshotStatus,
    pod_view,
    pv_view,
    pvc_view,
    snapshot_view,
    volume_attachment_view,
)
from controller_runtime.mounts import read_mounts
from controller_runtime.quantity import parse_quantity
from controller_runtime.toolchain import REPO_ROOT, Toolchain
from localstack.components import node_names
from localstack.leftovers import force_cleanup
from localstack.pools import SHARED, PoolMode
from localstack.proc import die_with_parent
from localstack.recipe_stack import inventory_filled

from . import oracles, report, reproducer
from .campaign import Outcome, scenario_name
from .faults import STEPS, Fault, FaultKind, step_of
from .lifecycle import RETRYABLE, DataAction, run_data_action
from .oracles import Finding
from .proxy import Call
from .recipe import Recipe
from .scenario import ScenarioResult

# The steps a stack scenario's calls go through (expansion and snapshots where the recipe has
# them), and the faults that test them best for their cost: a retry after the work was done, and
# two at once.
STACK_STEPS = (
    "CreateVolume",
    "NodeStageVolume",
    "NodePublishVolume",
    "ControllerExpandVolume",
    "NodeExpandVolume",
    "CreateSnapshot",
    "CreateVolumeFromSnapshot",
    "NodeUnpublishVolume",
    "NodeUnstageVolume",
    "DeleteSnapshot",
    "DeleteVolume",
)
STACK_KINDS = (FaultKind.KILL_AFTER, FaultKind.DUPLICATE)
# Every step the scenario's calls may take.
REACHED = (*STACK_STEPS, "ControllerPublishVolume", "ControllerUnpublishVolume")
READY_LINE = "kubeloop stack is ready"
CLAIM, RESTORED, SNAPSHOT = "data", "restored", "snap"
WRITER, READER, RESTORE_READER = "writer", "reader", "restore-reader"
NAMESPACE = "default"
# --sidecars: kubeloop's only, upstream's Go ones only, or kubeloop's with a second opinion from
# the Go ones on every scenario that found something.
SIDECARS = ("kubeloop", "go", "compare")


@dataclass(frozen=True)
class StackOptions:
    out: Path
    kinds: tuple[FaultKind, ...] = STACK_KINDS
    steps: tuple[str, ...] = STACK_STEPS
    timeout_seconds: float = 0.1  # the caller's deadline in a timeout fault
    # Flags added to the launcher's (a test's free ports); the defaults are `make up`'s fixed ports.
    launcher_args: tuple[str, ...] = ()
    start_timeout: float = 240.0  # two cores, cold cache: the apiserver alone can take tens of s
    # How long a pod may take to run, and the claim to be gone: the sidecars' and node agent's
    # backoffs after a fault are seconds, so a minute means stuck.
    pod_timeout: float = 60.0
    delete_timeout: float = 60.0
    # The simulated nodes: with two, the claim is read back on the other node (detach, attach).
    nodes: int = 2
    sidecars: str = "compare"
    # The stack's pool mode: node-local runs one instance of the recipe's command per node, each on
    # its own backend, and the claim is read back on its own node (its volume lives there).
    pools: PoolMode = SHARED


class StackError(RuntimeError):
    """The stack itself did not come up: not a finding about the driver."""


def plan(options: StackOptions) -> list[Fault | None]:
    return [None, *(Fault(kind, step) for kind in options.kinds for step in options.steps)]


async def run(recipe: Recipe, options: StackOptions, faults: Sequence[Fault | None] | None = None) -> Outcome:
    """Scenario after scenario (one stack at a time: its ports are fixed), the report at the end."""
    t0 = time.monotonic()
    shutil.rmtree(options.out / "reproducers", ignore_errors=True)
    results = []
    first = "go" if options.sidecars == "go" else "kubeloop"
    for index, fault in enumerate(plan(options) if faults is None else faults):
        name = scenario_name(index, fault)
        result = await run_scenario(recipe, options, fault, name, first)
        if result.findings:
            result.reproducer = reproducer.write(
                result, recipe.path, options.out / "reproducers" / f"{name}.json", options.timeout_seconds
            )
            if options.sidecars == "compare":
                result.verdicts = await second_opinion(recipe, options, result)
        results.append(result)
    seconds = time.monotonic() - t0
    settings = {
        "through": "the local stack (make up DRIVER=)",
        "sidecars": options.sidecars,
        "nodes": options.nodes,
        "timeout_seconds": options.timeout_seconds,
        "faults": ",".join(k.value for k in options.kinds),
    }
    j, m = report.write(options.out, report.to_json(str(recipe.path), results, settings, seconds))
    return Outcome(results, j, m, seconds)


DRIVER_VERDICT = "driver"  # found with the Go sidecars too
SIDECAR_VERDICT = "kubeloop's sidecars"  # gone with the Go sidecars in their place


def verdicts(ours: Sequence[Finding], theirs: Sequence[Finding] | None, why: str = "") -> dict[str, str]:
    """Each kind of finding of kubeloop's run -> whose bug it is, given the Go sidecars' run of the
    same scenario (None: it could not run, `why`)."""
    if theirs is None:
        return {f.kind: f"unknown ({why})" for f in ours}
    seen = {f.kind for f in theirs}
    return {f.kind: DRIVER_VERDICT if f.kind in seen else SIDECAR_VERDICT for f in ours}


async def second_opinion(recipe: Recipe, options: StackOptions, result: ScenarioResult) -> dict[str, str]:
    """The scenario again with upstream's Go sidecars: whose bug each finding is."""
    try:
        again = await run_scenario(recipe, options, result.fault, f"{result.name}-go-sidecars", "go")
    except StackError as e:
        return verdicts(result.findings, None, f"the stack with the Go sidecars did not come up: {e}")
    return verdicts(result.findings, again.findings)


class Stack:
    """One `python -m localstack.main up --driver-recipe R --driver-fault F` on its own home."""

    def __init__(
        self, recipe: Recipe, options: StackOptions, fault: Fault | None, logs: Path, sidecars: str
    ) -> None:
        self.recipe, self.options, self.fault, self.logs = recipe, options, fault, logs
        self.sidecars = sidecars
        # A short home: the node plugins' unix sockets live below it (107 bytes at most).
        self.home = Path(tempfile.mkdtemp(prefix="kls-", dir="/tmp"))
        self.kubectl_path = Toolchain.default().binary("kubectl")
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, "-m", "localstack.main", "up",
            f"--driver-recipe={self.recipe.path}",
            f"--driver-fault={self.fault.spec if self.fault else 'none'}",
            f"--nodes={self.options.nodes}",
            f"--sidecars={self.sidecars}",
            f"--pools={self.options.pools}",
            # Each scenario's etcd is thrown away with its home.
            "--etcd-unsafe-no-fsync",
            *self.options.launcher_args,
        ]  # fmt: skip
        out = (self.logs / "stack.stdout").open("wb")
        err = (self.logs / "stack.stderr").open("wb")
        with out, err:
            env = {**os.environ, "KUBELOOP_HOME": str(self.home)}
            # A campaign killed -9 leaves no stack behind holding the ports: its launcher is told
            # to stop, in order, when the campaign's process goes.
            self.proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=REPO_ROOT,
                env=env,
                stdout=out,
                stderr=err,
                preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
            )
        deadline = time.monotonic() + self.options.start_timeout
        while READY_LINE not in (self.logs / "stack.stdout").read_text(errors="replace"):
            if self.proc.returncode is not None or time.monotonic() > deadline:
                raise StackError(f"the stack did not come up ({self.proc.returncode}): {self.console()}")
            await asyncio.sleep(0.2)

    def console(self) -> str:
        tail = (self.logs / "stack.stderr").read_text(errors="replace")[-3000:]
        return f"see {self.logs}/stack.stdout; stderr ends:\n{tail}"

    async def kubectl(self, *args: str, stdin: str | None = None) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            str(self.kubectl_path),
            f"--kubeconfig={self.home / 'kubeconfig'}",
            *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await proc.communicate(stdin.encode() if stdin is not None else None)
        return proc.returncode or 0, out.decode(errors="replace")

    async def objects(self, kind: str, *args: str) -> list[dict[str, Any]]:
        code, out = await self.kubectl("get", kind, *args, "-o", "json")
        if code != 0:
            raise StackError(f"kubectl get {kind} failed: {out}")
        items: list[dict[str, Any]] = json.loads(out)["items"]
        return items

    async def stop(self) -> None:
        """SIGTERM (the node agent unmounts what is still mounted on its way out), then whatever
        still mentions the home is killed and unmounted: the next scenario's stack needs the ports,
        the machine none of it."""
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 90)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if str(self.home) in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid():
                    p.kill()
        force_cleanup(self.home)
        # The logs and calls outlive the home, in the scenario's directory of the report.
        for log in [*self.home.glob("logs/*.log"), *self.home.glob("components/*/*.log")]:
            shutil.copy(log, self.logs / f"{log.parent.name}-{log.name}")
        for calls in self.home.glob("components/*/calls.jsonl"):
            shutil.copy(calls, self.logs / f"{calls.parent.name}-calls.jsonl")
        shutil.rmtree(self.home, ignore_errors=True)

    def calls(self) -> tuple[list[Call], float]:
        """Every call the proxies saw, in one order by when each started (the wall clock), with
        `started` counted from the first (the reproducer's order); and the first's wall time."""
        lines = []
        for path in self.home.glob("components/*/calls.jsonl"):
            lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        lines.sort(key=lambda d: float(d["wall"]))
        t0 = float(lines[0]["wall"]) if lines else time.time()
        calls = [
            Call(
                seq=i,
                method=d["method"],
                request=base64.b64decode(d["request"]),
                started=float(d["wall"]) - t0,
                code=d["code"],
                details=d["details"],
                response=base64.b64decode(d["response"]) if d["response"] is not None else None,
                seconds=float(d["seconds"]),
                fault=d["fault"],
                extra=d["extra"],
            )
            for i, d in enumerate(lines)
        ]
        return calls, t0


def claim_manifest(recipe: Recipe, name: str, size: int, snapshot: str = "") -> dict[str, Any]:
    """A claim of the recipe's class; restored from the VolumeSnapshot `snapshot` when given."""
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": recipe.storage_class_name,
        "resources": {"requests": {"storage": str(size)}},
    }
    if snapshot:
        spec["dataSource"] = {
            "apiGroup": "snapshot.storage.k8s.io",
            "kind": "VolumeSnapshot",
            "name": snapshot,
        }
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


def snapshot_manifest(recipe: Recipe) -> dict[str, Any]:
    """A VolumeSnapshot of the claim in the recipe's class (recipe_stack names it as the storage
    class)."""
    return {
        "apiVersion": "snapshot.storage.k8s.io/v1",
        "kind": "VolumeSnapshot",
        "metadata": {"name": SNAPSHOT, "namespace": NAMESPACE},
        "spec": {
            "volumeSnapshotClassName": recipe.storage_class_name,
            "source": {"persistentVolumeClaimName": CLAIM},
        },
    }


def pod_manifest(name: str, claim: str, node: str) -> dict[str, Any]:
    """A pod of the claim for `node`, placed there by the scheduler (which also picks a
    WaitForFirstConsumer claim's node that way): the scenario picks the node, so a reader lands on
    the other one. The node agent runs no containers: "the pod writes" is the campaign writing
    through the pod's volume directory, where the node plugin published it."""
    mount = {"name": "d", "mountPath": "/d"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [{"name": "app", "image": "busybox", "volumeMounts": [mount]}],
            "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": claim}}],
        },
    }


def target_path(home: Path, obj: dict[str, Any], pv: str) -> str:
    """Where the node agent had the pod's volume published (kubelet's layout)."""
    pod = pod_view(obj)
    uid = pod["metadata"]["uid"]
    kubelet = home / "nodes" / pod["spec"]["nodeName"] / "kubelet"
    return str(kubelet / "pods" / uid / "volumes" / "kubernetes.io~csi" / pv / "mount")


def published_twice(home: Path) -> list[Finding]:
    """A staging or target path under the nodes mounted more than once."""
    counts = Counter(m.mountpoint for m in read_mounts() if m.mountpoint.startswith(f"{home}/nodes/"))
    return [Finding("published-twice", f"{path} is mounted {n} times") for path, n in counts.items() if n > 1]


def failed_calls(calls: Sequence[Call]) -> list[Finding]:
    """Lifecycle calls the driver answered with an error the sidecars retry forever (or give up
    on): once per step and code, with how often. The proxy's own injected errors are retryable."""
    seen: Counter[tuple[str, str]] = Counter()
    details: dict[tuple[str, str], str] = {}
    retryable = {code.name for code in RETRYABLE}
    for c in calls:
        if c.code == "OK" or c.code in retryable:
            continue
        key = (step_of(c.method, c.request), c.code)
        # Only the lifecycle's steps: a discovery call's error is an answer (a node-only instance
        # of a plugin that reports CONTROLLER_SERVICE answers ControllerGetCapabilities with
        # UNIMPLEMENTED, which the sidecars and the node agent read as "no capabilities").
        if key[0] not in STEPS:
            continue
        seen[key] += 1
        details.setdefault(key, c.details)
    # "<step> answered <CODE>" is what diagnosis.headline reads.
    return [
        Finding("call-failed", f"{step} answered {code}: {details[step, code]} ({n} times)")
        for (step, code), n in seen.items()
    ]


class Scenario:
    """The scenario's Kubernetes part: claim and writer pod, reader pod, deletion, and the
    oracles as it goes."""

    def __init__(self, stack: Stack, recipe: Recipe, options: StackOptions, name: str) -> None:
        self.stack, self.recipe, self.options, self.name = stack, recipe, options, name
        self.findings: list[Finding] = []
        self.data: list[tuple[float, DataAction]] = []  # with when it ran, to place among the calls

    async def apply(self, *docs: dict[str, Any]) -> None:
        code, out = await self.stack.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))
        if code != 0:
            raise StackError(f"kubectl apply failed: {out}")

    async def running(self, pod: str) -> dict[str, Any] | None:
        """The pod once Running, within pod_timeout; else a pod-not-running finding and None."""
        deadline = time.monotonic() + self.options.pod_timeout
        while True:
            found = await self.stack.objects("pods", "-n", NAMESPACE, f"--field-selector=metadata.name={pod}")
            if found and pod_view(found[0])["status"].get("phase") == "Running":
                return found[0]
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        status = pod_view(found[0])["status"] if found else PodStatus()
        events = await self.stack.objects("events", "-n", NAMESPACE)
        said = [e.get("message", "") for e in events if e.get("involvedObject", {}).get("name") == pod]
        self.findings.append(
            Finding(
                "pod-not-running",
                f"pod {pod} not Running after {self.options.pod_timeout:g}s (phase "
                f"{status.get('phase', 'gone')}); its last events: {said[-3:]}",
            )
        )
        return None

    def act(self, kind: str, path: str) -> None:
        # The data actions' after_call is set once the calls are merged (see run_scenario).
        action = DataAction(kind, path, self.name, 0)
        self.data.append((time.time(), action))
        finding = run_data_action(action)
        self.findings += [finding] if finding else []

    async def delete(self, *what: str) -> None:
        await self.stack.kubectl("delete", *what, "-n", NAMESPACE, "--wait=false", "--ignore-not-found")

    async def pv_name(self, claim: str) -> str:
        claims = await self.stack.objects("pvc", "-n", NAMESPACE, f"--field-selector=metadata.name={claim}")
        return pvc_view(claims[0])["spec"].get("volumeName", "") if claims else ""

    async def pod(self, name: str, claim: str, node: str) -> tuple[dict[str, Any] | None, str]:
        """The pod created and Running (None if not), and its claim's PV."""
        await self.apply(pod_manifest(name, claim, node))
        return await self.running(name), await self.pv_name(claim)

    async def until(self, what: str, check: Callable[[], Awaitable[str | None]]) -> bool:
        """Polls `check` (None once done, else what it sees) for pod_timeout; a `what` finding
        with the last thing seen when it never is."""
        deadline = time.monotonic() + self.options.pod_timeout
        while (seen := await check()) is not None:
            if time.monotonic() > deadline:
                self.findings.append(Finding(what, f"not within {self.options.pod_timeout:g}s: {seen}"))
                return False
            await asyncio.sleep(0.5)
        return True

    async def expand(self) -> None:
        """The claim grown to the recipe's expand_to while its pod runs (online: controller, then
        node expansion), done when its status capacity says so."""
        size = self.recipe.volume.expand_to_bytes
        patch = {"spec": {"resources": {"requests": {"storage": str(size)}}}}
        await self.stack.kubectl(
            "patch", "pvc", CLAIM, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch)
        )

        async def grown() -> str | None:
            [claim] = await self.stack.objects(
                "pvc", "-n", NAMESPACE, f"--field-selector=metadata.name={CLAIM}"
            )
            status = pvc_view(claim)["status"]
            if parse_quantity(status.get("capacity", {}).get("storage", "0")) >= size:
                return None
            conditions = [f"{c.get('type')}: {c.get('message', '')}" for c in status.get("conditions", [])]
            return f"claim {CLAIM} capacity {status.get('capacity', {})}, conditions {conditions}"

        await self.until("expansion-stuck", grown)

    async def snapshot(self) -> bool:
        """A VolumeSnapshot of the claim, ready to use; then a claim restored from it."""
        await self.apply(snapshot_manifest(self.recipe))

        async def ready() -> str | None:
            found = await self.stack.objects(
                "volumesnapshots", "-n", NAMESPACE, f"--field-selector=metadata.name={SNAPSHOT}"
            )
            if not found:
                return f"no VolumeSnapshot {SNAPSHOT}"
            status = snapshot_view(found[0]).get("status", VolumeSnapshotStatus())
            return None if status.get("readyToUse") else f"VolumeSnapshot {SNAPSHOT} status {status}"

        if not await self.until("snapshot-not-ready", ready):
            return False
        size = self.recipe.volume.expand_to_bytes if self.expands else self.recipe.volume.size_bytes
        await self.apply(claim_manifest(self.recipe, RESTORED, size, SNAPSHOT))
        return True

    @property
    def expands(self) -> bool:
        sc = self.recipe.storage_class
        return bool(sc.get("allowVolumeExpansion")) and self.recipe.volume.expand_to_bytes > 0

    async def run(self) -> None:
        nodes = node_names(self.options.nodes)
        first = nodes[0]
        # A shared volume follows its pod to another node; a node-local one is read where it lives.
        last = nodes[-1] if self.options.pools == SHARED else first
        await self.apply(claim_manifest(self.recipe, CLAIM, self.recipe.volume.size_bytes))
        writer, pv = await self.pod(WRITER, CLAIM, first)
        restored = False
        if writer is not None:
            self.findings += published_twice(self.stack.home)
            self.act("write", target_path(self.stack.home, writer, pv))
            if self.expands:
                await self.expand()
            if self.recipe.snapshots:
                restored = await self.snapshot()
        await self.delete("pod", WRITER)
        await self.gone("pods", WRITER)
        if writer is not None:
            # Read back on the other node (NodeUnpublish, NodeUnstage and a detach before it),
            # and from the restored claim.
            reader, pv = await self.pod(READER, CLAIM, last)
            if reader is not None:
                self.act("verify", target_path(self.stack.home, reader, pv))
            if restored:
                restore_reader, restored_pv = await self.pod(RESTORE_READER, RESTORED, first)
                if restore_reader is not None:
                    self.act("verify", target_path(self.stack.home, restore_reader, restored_pv))
            await self.delete("pod", READER, RESTORE_READER)
            await self.gone("pods", READER)
            await self.gone("pods", RESTORE_READER)
        await self.delete("volumesnapshot", SNAPSHOT)
        await self.delete("pvc", CLAIM, RESTORED)
        await self.stuck()

    async def gone(self, kind: str, name: str) -> None:
        deadline = time.monotonic() + self.options.delete_timeout
        while time.monotonic() < deadline:
            if not await self.stack.objects(kind, "-n", NAMESPACE, f"--field-selector=metadata.name={name}"):
                return
            await asyncio.sleep(0.5)

    async def leftover(self) -> list[Finding]:
        """What the deletion should have removed and has not: pods, the claim, the driver's PVs
        and VolumeAttachments, each with its finalizers (what holds it)."""
        driver = self.recipe.driver_name
        found = []

        def held(o: dict[str, Any]) -> str:
            meta = cast("KubeObject", o)["metadata"]
            deleting = "deletionTimestamp" in meta
            return f"{meta['name']} (finalizers {meta.get('finalizers', [])}, deleting: {deleting})"

        pods = await self.stack.objects("pods", "-n", NAMESPACE)
        claims = await self.stack.objects("pvc", "-n", NAMESPACE)
        pvs = [
            pv
            for pv in await self.stack.objects("pv")
            if not driver or pv_view(pv)["spec"].get("csi", {}).get("driver") == driver
        ]
        vas = [
            va
            for va in await self.stack.objects("volumeattachments")
            if not driver or volume_attachment_view(va)["spec"].get("attacher") == driver
        ]
        snapshots: list[dict[str, Any]] = []
        contents: list[dict[str, Any]] = []
        if self.recipe.snapshots:
            snapshots = await self.stack.objects("volumesnapshots", "-n", NAMESPACE)
            contents = await self.stack.objects("volumesnapshotcontents")
        for kind, items in (
            ("pod", pods),
            ("pvc", claims),
            ("pv", pvs),
            ("volumeattachment", vas),
            ("volumesnapshot", snapshots),
            ("volumesnapshotcontent", contents),
        ):
            if items:
                found.append(
                    Finding(
                        f"stuck-{kind}",
                        f"{len(items)} left {self.options.delete_timeout:g}s after the claim's "
                        f"deletion: {[held(o) for o in items]}",
                    )
                )
        return found

    async def stuck(self) -> None:
        deadline = time.monotonic() + self.options.delete_timeout
        while True:
            left = await self.leftover()
            if not left or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        self.findings += left


async def inventory(recipe: Recipe, options: StackOptions, home: Path) -> oracles.Objects | None:
    """What the backend holds: the recipe's inventory command with the controller instance's
    placeholders, or with node-local pools every node's, put together."""
    held = None
    for filled in inventory_filled(recipe, home, options.pools, node_names(options.nodes)):
        part = await oracles.inventory_of(recipe, filled, home)
        if part is None:
            return None
        held = (
            part
            if held is None
            else oracles.Objects(held.volumes | part.volumes, held.snapshots | part.snapshots)
        )
    return held


async def run_scenario(
    recipe: Recipe, options: StackOptions, fault: Fault | None, name: str, sidecars: str = "kubeloop"
) -> ScenarioResult:
    t0 = time.monotonic()
    stack = Stack(recipe, options, fault, options.out / "scenarios" / name, sidecars)
    home = stack.home
    scenario = Scenario(stack, recipe, options, name)
    try:
        await stack.start()
        await scenario.run()
        calls, wall0 = stack.calls()
        findings = [*failed_calls(calls), *scenario.findings]
        # The end state, judged with the stack still up: its stop unmounts whatever is left.
        try:
            held = await inventory(recipe, options, home)
        except oracles.InventoryError as e:
            findings.append(Finding("inventory-failed", str(e)))
        else:
            if held is not None:
                believed = oracles.belief((c.method, c.request, c.response, c.code) for c in calls)
                findings += oracles.compare(believed, held)
        findings += oracles.leftovers(home)
    finally:
        await stack.stop()
    # A data action ran after the calls that had ended by then, as in a reproducer of the bench.
    data = [
        DataAction(a.kind, a.path, a.seed, sum(1 for c in calls if wall0 + c.started + c.seconds <= when))
        for when, a in scenario.data
    ]
    return ScenarioResult(
        name=name,
        fault=fault,
        # Paths in the calls are under the nodes' directories: a replay moves them to its own.
        work=home / "nodes" / node_names(options.nodes)[0],
        findings=oracles.dedupe(findings),
        calls=calls,
        data=data,
        seconds=time.monotonic() - t0,
        fired=any(c.fault for c in calls),
        # The Kubernetes objects are judged whatever happened; the replay judges the end state too.
        completed=True,
        also_work=[home / "nodes" / n for n in node_names(options.nodes)[1:]],
    )
