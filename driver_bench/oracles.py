"""What a scenario is judged by once its lifecycles end, the same in a campaign and in a replay:

- the backend's inventory (the recipe's list command) against what the caller believes exists,
  which is what the driver told it: an object the caller never heard of, or one it deleted, is a
  leak nobody will ever delete; one it holds and the backend lost is data gone;
- mounts and loop devices left under the scenario's directories once everything was unpublished,
  unstaged and deleted;
- a path mounted more than once (a volume published twice on one target), checked as the caller
  goes;
- the data written through a target, read back after expansion and from a restored snapshot
  (`lifecycle.run_data_action`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller_runtime.mounts import read_mounts
from localstack.leftovers import find_leftovers

from . import messages
from .recipe import Filled, Recipe, fill
from .runner import Layout, ServiceProcess

# The stack campaign's findings read from Kubernetes objects (driver_bench/stack_campaign.py): a
# replay against the driver alone has none of those objects, so it cannot judge them.
KUBERNETES_KINDS = frozenset(
    {"pod-not-running", "stuck-pod", "stuck-pvc", "stuck-pv", "stuck-volumeattachment"}
)


@dataclass(frozen=True)
class Finding:
    kind: str  # leaked-volume, call-failed, leftover-mount... (docs/driver-bench.md lists them)
    summary: str

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "summary": self.summary}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> Finding:
        return Finding(str(doc["kind"]), str(doc["summary"]))


@dataclass(frozen=True)
class Objects:
    volumes: frozenset[str]
    snapshots: frozenset[str]


class InventoryError(Exception):
    pass


def belief(calls: Iterable[tuple[str, bytes, bytes | None, str]]) -> Objects:
    """What the caller believes exists, from (method, request, response, code) in call order: what
    it was told was created and has not deleted since. An answer that never reached it (dropped,
    or lost with a killed driver) tells it nothing."""
    volumes: set[str] = set()
    snapshots: set[str] = set()
    for method, request, response, code in calls:
        if code != "OK" or not messages.known(method):
            continue
        short = messages.short_name(method)
        if short == "CreateVolume" and response is not None:
            volumes.add(messages.decode(method, response, response=True).volume.volume_id)
        elif short == "DeleteVolume":
            volumes.discard(messages.decode(method, request).volume_id)
        elif short == "CreateSnapshot" and response is not None:
            snapshots.add(messages.decode(method, response, response=True).snapshot.snapshot_id)
        elif short == "DeleteSnapshot":
            snapshots.discard(messages.decode(method, request).snapshot_id)
    return Objects(frozenset(volumes), frozenset(snapshots))


async def inventory(recipe: Recipe, layout: Layout) -> Objects | None:
    """The backend's objects by the recipe's list command; None when the recipe has none."""
    return await inventory_of(recipe, ServiceProcess(recipe, recipe.controller, layout).filled(), layout.work)


async def inventory_of(recipe: Recipe, filled: Filled, cwd: Path) -> Objects | None:
    """The same with the placeholders of any instance (the local stack's controller plugin's)."""
    if recipe.inventory is None:
        return None
    argv = [fill(a, filled.values()) for a in recipe.inventory.command]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=cwd
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), recipe.inventory.timeout_seconds)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise InventoryError(
            f"the inventory command did not finish in {recipe.inventory.timeout_seconds:g}s"
        ) from None
    if proc.returncode != 0:
        raise InventoryError(f"the inventory command exited with {proc.returncode}: {err.decode().strip()}")
    volumes: set[str] = set()
    snapshots: set[str] = set()
    for line in out.decode().splitlines():
        kind, _, ident = line.strip().partition(" ")
        if not line.strip():
            continue
        if kind == "volume":
            volumes.add(ident.strip())
        elif kind == "snapshot":
            snapshots.add(ident.strip())
        else:
            raise InventoryError(
                f"the inventory command printed {line!r}: want `volume <id>` or `snapshot <id>`"
            )
    return Objects(frozenset(volumes), frozenset(snapshots))


def compare(believed: Objects, held: Objects) -> list[Finding]:
    out = []
    for kind, b, h in (
        ("volume", believed.volumes, held.volumes),
        ("snapshot", believed.snapshots, held.snapshots),
    ):
        if h - b:
            out.append(
                Finding(
                    f"leaked-{kind}", f"the backend holds {kind}s the caller does not know: {sorted(h - b)}"
                )
            )
        if b - h:
            out.append(Finding(f"lost-{kind}", f"the caller holds {kind}s the backend lost: {sorted(b - h)}"))
    return out


def leftovers(work: Path) -> list[Finding]:
    found = find_leftovers(work)
    out = []
    if found.mounts:
        out.append(Finding("leftover-mount", f"mounted after the lifecycle ended: {sorted(found.mounts)}"))
    if found.loop_devices:
        devices = [f"{dev} ({back})" for dev, back in found.loop_devices]
        out.append(Finding("leftover-loop-device", f"attached after the lifecycle ended: {devices}"))
    return out


def stacked_mounts(path: str) -> Finding | None:
    """A path mounted more than once: a publish or stage that mounted again over its own mount."""
    count = sum(1 for m in read_mounts() if m.mountpoint == path)
    if count > 1:
        return Finding("published-twice", f"{path} is mounted {count} times")
    return None


def dedupe(findings: Iterable[Finding]) -> list[Finding]:
    return list(dict.fromkeys(findings))
