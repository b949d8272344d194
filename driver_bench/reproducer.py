"""Reproducers: a finding as a file of the raw CSI calls that led to it and the fault, and its
replay against the driver alone.

The file holds every call the caller made in the scenario, in the order the proxy saw them
(method, request as JSON by protobuf's json_format, the code and answer it got), the files written
and read back between calls, the fault, the recipe and the findings. `replay` starts the driver
from the recipe on fresh directories, sends the same calls one at a time through the same fault,
and judges with the same oracles. Ids the driver chooses (volume and snapshot ids) differ from
run to run, so each id an answer gives is mapped to the one the replay's answer gives, and paths
under the scenario's kubelet directory are moved to the replay's."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kubeloop_grpc.csi import csi_pb2

from . import messages
from .diagnosis import headline
from .faults import Fault, step_of
from .lifecycle import RETRYABLE, DataAction, prepare_paths, run_data_action
from .oracles import KUBERNETES_KINDS, Finding, stacked_mounts
from .recipe import load
from .scenario import Bench, ScenarioResult

FORMAT = "kubeloop.driver-bench.reproducer/v1"
ID_FIELDS = ("volume_id", "snapshot_id", "source_volume_id")


def write(result: ScenarioResult, recipe_path: Path, path: Path, timeout_seconds: float) -> Path:
    calls = []
    for c in result.calls:
        # started and ended (seconds since the proxy started) say which calls overlapped.
        entry: dict[str, Any] = {
            "method": c.method,
            "code": c.code,
            "started": round(c.started, 6),
            "ended": round(c.started + c.seconds, 6),
        }
        if messages.known(c.method):
            entry["request"] = messages.to_json(c.method, c.request)
            if c.response is not None:
                entry["response"] = messages.to_json(c.method, c.response, response=True)
        if c.fault:
            entry["fault"] = c.fault
        if c.details:
            entry["details"] = c.details
        calls.append(entry)
    doc = {
        "format": FORMAT,
        "recipe": str(recipe_path),
        "scenario": result.name,
        "fault": result.fault.to_json() if result.fault else None,
        "timeout_seconds": timeout_seconds,
        "work": str(result.work),
        "also_work": [str(w) for w in result.also_work],
        # A lifecycle that ended early left its volume in use: its end state is judged only if
        # the calls ran to their end, in the campaign and in the replay alike.
        "completed": result.completed,
        "findings": [{**f.to_json(), "headline": headline(result.fault, f)} for f in result.findings],
        "calls": calls,
        "data": [d.to_json() for d in result.data],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def _ids(doc: Any, found: list[str]) -> list[str]:
    """Every id field's value in a JSON message, depth first (the same order in any two answers)."""
    if isinstance(doc, dict):
        for key in sorted(doc):
            if key in ID_FIELDS and isinstance(doc[key], str):
                found.append(doc[key])
            else:
                _ids(doc[key], found)
    elif isinstance(doc, list):
        for item in doc:
            _ids(item, found)
    return found


def _rewrite(doc: Any, change: Callable[[str], str]) -> Any:
    if isinstance(doc, dict):
        return {k: _rewrite(v, change) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_rewrite(v, change) for v in doc]
    return change(doc) if isinstance(doc, str) else doc


@dataclass
class Translation:
    """Recorded ids and paths to the replay's. Replaced wherever they occur in a string, since
    drivers embed them in others (a publish context naming `volumes/<id>.img`, a state path)."""

    old_works: list[str]
    new_work: str
    ids: dict[str, str]

    def __call__(self, value: str) -> str:
        # The longest first, so an id that contains another is replaced whole.
        for old in sorted(self.ids, key=len, reverse=True):
            value = value.replace(old, self.ids[old])
        for work in self.old_works:
            value = value.replace(work + "/", self.new_work + "/")
        return value

    def learn(self, recorded: Any, replayed: Any) -> None:
        for old, new in zip(_ids(recorded, []), _ids(replayed, []), strict=False):
            if old != new:
                self.ids.setdefault(old, new)


class _Sender:
    """Sends recorded calls (ids and paths translated) and runs the data actions, collecting what
    the oracles that judge as the caller goes find."""

    def __init__(self, channel: grpc.aio.Channel, tr: Translation) -> None:
        self.channel, self.tr = channel, tr
        self.findings: list[Finding] = []
        self.failed = False

    def data(self, action: DataAction) -> None:
        finding = run_data_action(action)
        self.findings += [finding] if finding else []

    async def send(self, entry: dict[str, Any]) -> None:
        if "request" not in entry:
            return
        method = entry["method"]
        request = messages.from_json(method, _rewrite(entry["request"], self.tr))
        decoded = messages.decode(method, request)
        prepare_paths(decoded)
        try:
            answer = await self.channel.unary_unary(method)(request, timeout=30)
        except grpc.aio.AioRpcError as e:
            if e.code() not in RETRYABLE:
                step = step_of(method, request)
                self.findings.append(
                    Finding("call-failed", f"{step} answered {e.code().name}: {e.details()}")
                )
                self.failed = True
            return
        if "response" in entry:
            self.tr.learn(entry["response"], messages.to_json(method, bytes(answer), response=True))
        path = ""
        if isinstance(decoded, csi_pb2.NodeStageVolumeRequest):
            path = decoded.staging_target_path
        elif isinstance(decoded, csi_pb2.NodePublishVolumeRequest):
            path = decoded.target_path
        stacked = stacked_mounts(path) if path else None
        self.findings += [stacked] if stacked else []


@dataclass
class Replay:
    fault: Fault | None
    findings: list[Finding]
    recorded: list[Finding]
    seconds: float
    work: Path

    @property
    def reproduced(self) -> bool:
        """Every kind of finding the campaign recorded that a replay can judge is found again (a
        stack campaign's Kubernetes-level findings are not: `oracles.KUBERNETES_KINDS`)."""
        kinds = {f.kind for f in self.findings}
        judged = [f for f in self.recorded if f.kind not in KUBERNETES_KINDS]
        return bool(judged) and all(f.kind in kinds for f in judged)


def read(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a driver-bench reproducer (format {doc.get('format')!r})")
    return doc


async def replay(path: Path, work: Path) -> Replay:
    doc = read(path)
    recipe = load(doc["recipe"])
    fault = Fault.from_json(doc["fault"]) if doc.get("fault") else None
    data = [DataAction.from_json(d) for d in doc["data"]]
    recorded = [Finding.from_json(f) for f in doc["findings"]]
    t0 = time.monotonic()
    findings: list[Finding] = []
    async with Bench(recipe, work, fault, float(doc["timeout_seconds"])) as bench:
        tr = Translation([doc["work"], *doc.get("also_work", [])], str(bench.layout.work), {})
        async with grpc.aio.insecure_channel(bench.proxy.endpoint) as channel:
            sender = _Sender(channel, tr)
            calls: list[dict[str, Any]] = doc["calls"]
            tasks: list[asyncio.Task[None]] = []
            for index, entry in enumerate(calls):
                for action in (a for a in data if a.after_call == index):
                    # The lifecycle wrote or read after its calls so far were answered.
                    await asyncio.gather(*tasks)
                    sender.data(DataAction(action.kind, tr(action.path), action.seed, index))
                # Calls that overlapped in the campaign overlap here: a call waits only for those
                # that had ended before it started, so a kill -9 lands on the same calls in flight.
                await asyncio.gather(
                    *(t for j, t in enumerate(tasks) if calls[j]["ended"] <= entry["started"])
                )
                tasks.append(asyncio.ensure_future(sender.send(entry)))
            await asyncio.gather(*tasks)
            for action in (a for a in data if a.after_call >= len(calls)):
                sender.data(DataAction(action.kind, tr(action.path), action.seed, action.after_call))
        findings = await bench.judge(sender.findings, completed=bool(doc["completed"]) and not sender.failed)
    return Replay(fault, findings, recorded, time.monotonic() - t0, work)
