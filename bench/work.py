"""Work per operation (issue 33): the API requests the apiserver served and the CSI calls the driver
served during a run, from their Prometheus counters scraped before and after it.

`apiserver_request_total` has no label for the client, so a count is everything the apiserver
served in the window: the side under test, and the parts both sides share (the benchmark's own
creates and watches, the pv-controller, kcm). Those shared parts do the same on both sides, so the
difference between the sides is the difference between the components compared. CSI calls are
counted by the driver (`csi_operations_seconds_count`), which only the side under test calls.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from localstack.controlplane import ControlPlane


def samples(text: str, metric: str) -> list[tuple[dict[str, str], float]]:
    """The labelled samples named `metric` in Prometheus' text format (prometheus_client's parser,
    as `kubectl kubeloop get volumes` reads a node's metrics)."""
    return [
        (dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == metric
    ]


def api_requests(text: str) -> Counter[str]:
    """Requests served, by `VERB resource[/subresource]` (WATCH and LIST apart, as the apiserver
    counts them)."""
    counts: Counter[str] = Counter()
    for labels, value in samples(text, "apiserver_request_total"):
        resource = labels.get("resource", "")
        if labels.get("subresource"):
            resource += "/" + labels["subresource"]
        counts[f"{labels.get('verb', '?')} {resource or labels.get('path', '?')}"] += int(value)
    return counts


def csi_calls(text: str) -> Counter[str]:
    """Calls the driver served, by method (every status code)."""
    counts: Counter[str] = Counter()
    for labels, value in samples(text, "csi_operations_seconds_count"):
        counts[labels.get("method_name", "?")] += int(value)
    return counts


async def apiserver_metrics(cp: ControlPlane) -> str:
    proc = await asyncio.create_subprocess_exec(
        str(cp.toolchain.binary("kubectl")), f"--kubeconfig={cp.admin_kubeconfig}",
        "get", "--raw", "/metrics",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the apiserver's /metrics: {err.decode().strip()}")
    return out.decode()


async def http_metrics(endpoint: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"http://{endpoint}/metrics") as resp:
        resp.raise_for_status()
        return await resp.text()


@dataclass
class WorkCounts:
    """What was served between `start` and `stop`: API requests and CSI calls by kind."""

    cp: ControlPlane
    driver_endpoint: str | None = None
    api: Counter[str] = field(default_factory=Counter)
    csi: Counter[str] = field(default_factory=Counter)

    async def _read(self) -> tuple[Counter[str], Counter[str]]:
        api = api_requests(await apiserver_metrics(self.cp))
        csi = csi_calls(await http_metrics(self.driver_endpoint)) if self.driver_endpoint else Counter()
        return api, csi

    async def start(self) -> None:
        self._before = await self._read()

    async def stop(self, quiet_s: float = 2.0, limit_s: float = 60.0) -> None:
        """Takes the second reading once the writes have settled: no new POST, PUT, PATCH or DELETE
        for `quiet_s` (at most `limit_s`). A component that writes its events from a queue after
        the operation is done (client-go's broadcaster) is then counted as fully as one that
        writes them inline."""
        deadline = time.monotonic() + limit_s
        api, csi = await self._read()
        while time.monotonic() < deadline:
            await asyncio.sleep(quiet_s)
            later, csi = await self._read()
            if _writes(later) == _writes(api):
                break
            api = later
        self.api = api - self._before[0]
        self.csi = csi - self._before[1]

    def figures(self, operations: int) -> dict[str, Any]:
        """Totals per operation (figures the method summarises) and the breakdowns behind them."""
        return {
            "api_requests_per_op": round(sum(self.api.values()) / operations, 2),
            "csi_calls_per_op": round(sum(self.csi.values()) / operations, 2),
            "api_requests": per_op(self.api, operations),
            "csi_calls": per_op(self.csi, operations),
        }


def _writes(counts: Counter[str]) -> int:
    return sum(n for kind, n in counts.items() if kind.split(" ", 1)[0] in ("POST", "PUT", "PATCH", "DELETE"))


def per_op(counts: Mapping[str, int], operations: int) -> dict[str, float]:
    """Each kind's count per operation, largest first, kinds under 0.01 per operation left out."""
    return {
        kind: round(n / operations, 2)
        for kind, n in sorted(counts.items(), key=lambda kv: -kv[1])
        if n / operations >= 0.01
    }
