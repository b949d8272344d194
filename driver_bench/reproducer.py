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

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from . import messages
from .faults import Fault, step_of
from .lifecycle import RETRYABLE, DataAction, prepare_paths, run_data_action
from .oracles import Finding, stacked_mounts
from .recipe import load
from .scenario import Bench, ScenarioResult

FORMAT = "kubeloop.driver-bench.reproducer/v1"
ID_FIELDS = ("volume_id", "snapshot_id", "source_volume_id")


def write(result: ScenarioResult, recipe_path: Path, path: Path, timeout_seconds: float) -> Path:
    calls = []
    for c in result.calls:
        entry: dict[str, Any] = {"method": c.method, "code": c.code}
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
        "kubelet_dir": str(result.kubelet_dir),
        "findings": [f.to_json() for f in result.findings],
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
    """Recorded ids and paths to the replay's."""

    old_kubelet: str
    new_kubelet: str
    ids: dict[str, str]

    def __call__(self, value: str) -> str:
        if value in self.ids:
            return self.ids[value]
        if value == self.old_kubelet or value.startswith(self.old_kubelet + "/"):
            return self.new_kubelet + value[len(self.old_kubelet) :]
        return value

    def learn(self, recorded: Any, replayed: Any) -> None:
        for old, new in zip(_ids(recorded, []), _ids(replayed, []), strict=False):
            self.ids.setdefault(old, new)


@dataclass
class Replay:
    findings: list[Finding]
    recorded: list[Finding]
    seconds: float
    work: Path

    @property
    def reproduced(self) -> bool:
        """Every kind of finding the campaign recorded is found again."""
        kinds = {f.kind for f in self.findings}
        return bool(self.recorded) and all(f.kind in kinds for f in self.recorded)


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
        tr = Translation(doc["kubelet_dir"], str(bench.layout.kubelet_dir), {})
        failed = False
        async with grpc.aio.insecure_channel(bench.proxy.endpoint) as channel:
            for index, entry in enumerate(doc["calls"]):
                for action in data:
                    if action.after_call == index:
                        moved = DataAction(action.kind, tr(action.path), action.seed, index)
                        finding = run_data_action(moved)
                        findings += [finding] if finding else []
                if "request" not in entry:
                    continue
                method = entry["method"]
                request = messages.from_json(method, _rewrite(entry["request"], tr))
                prepare_paths(messages.decode(method, request))
                try:
                    answer = await channel.unary_unary(method)(request, timeout=30)
                except grpc.aio.AioRpcError as e:
                    if e.code() not in RETRYABLE:
                        step = step_of(method, request)
                        findings.append(
                            Finding("call-failed", f"{step} answered {e.code().name}: {e.details()}")
                        )
                        failed = True
                    continue
                if "response" in entry:
                    tr.learn(entry["response"], messages.to_json(method, bytes(answer), response=True))
                short = messages.short_name(method)
                if short in ("NodeStageVolume", "NodePublishVolume"):
                    req = messages.decode(method, request)
                    target = getattr(
                        req, "staging_target_path" if short == "NodeStageVolume" else "target_path"
                    )
                    stacked = stacked_mounts(target)
                    findings += [stacked] if stacked else []
            for action in data:
                if action.after_call >= len(doc["calls"]):
                    finding = run_data_action(
                        DataAction(action.kind, tr(action.path), action.seed, action.after_call)
                    )
                    findings += [finding] if finding else []
        findings = await bench.judge(findings, completed=not failed)
    return Replay(findings, recorded, time.monotonic() - t0, work)
