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
from collections.abc import Callable, Mapping
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


def _kind(labels: dict[str, str]) -> str:
    resource = labels.get("resource", "")
    if labels.get("subresource"):
        resource += "/" + labels["subresource"]
    return f"{labels.get('verb', '?')} {resource or labels.get('path', '?')}"


def totals(text: str, metric: str, key: Callable[[dict[str, str]], str]) -> Counter[str]:
    """The samples of `metric` summed by `key` of their labels (counts stay whole numbers)."""
    sums: Counter[str] = Counter()
    for labels, value in samples(text, metric):
        sums[key(labels)] += value  # type: ignore[assignment]  # Counter holds floats as well
    return sums


def _label(name: str) -> Callable[[dict[str, str]], str]:
    return lambda labels: labels.get(name, "?")


def api_requests(text: str) -> Counter[str]:
    """Requests served, by `VERB resource[/subresource]` (WATCH and LIST apart, as the apiserver
    counts them)."""
    return totals(text, "apiserver_request_total", _kind)


def api_seconds(text: str) -> Counter[str]:
    """Seconds the apiserver spent serving requests, by the same kinds: the server's share of a
    request's latency, apart from the client's (its limiter, its connections, its own CPU)."""
    return totals(text, "apiserver_request_duration_seconds_sum", _kind)


def flow_control_waits(text: str) -> tuple[Counter[str], Counter[str]]:
    """Requests and the seconds they waited in API Priority and Fairness' queues before being
    served, by priority level (an exempt request waits for none)."""
    wait = "apiserver_flowcontrol_request_wait_duration_seconds"
    level = _label("priority_level")
    return totals(text, f"{wait}_count", level), totals(text, f"{wait}_sum", level)


def csi_calls(text: str) -> Counter[str]:
    """Calls the driver served, by method (every status code)."""
    return totals(text, "csi_operations_seconds_count", _label("method_name"))


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
class Reading:
    """One scrape's counters, all cumulative; `Reading - Reading` is what was served between."""

    api: Counter[str] = field(default_factory=Counter)  # requests by kind
    api_s: Counter[str] = field(default_factory=Counter)  # seconds serving them, by kind
    csi: Counter[str] = field(default_factory=Counter)  # driver calls by method
    waits: Counter[str] = field(default_factory=Counter)  # flow-control waits by priority level
    waits_s: Counter[str] = field(default_factory=Counter)  # seconds waited, by priority level

    def __sub__(self, before: Reading) -> Reading:
        return Reading(
            self.api - before.api,
            self.api_s - before.api_s,
            self.csi - before.csi,
            self.waits - before.waits,
            self.waits_s - before.waits_s,
        )


@dataclass
class WorkCounts:
    """What was served between `start` and `stop`: API requests and CSI calls by kind, the
    apiserver's time serving them, and the time they waited for a seat in its flow control."""

    cp: ControlPlane
    driver_endpoint: str | None = None
    served: Reading = field(default_factory=Reading)

    async def _read(self) -> Reading:
        text = await apiserver_metrics(self.cp)
        csi = csi_calls(await http_metrics(self.driver_endpoint)) if self.driver_endpoint else Counter()
        return Reading(api_requests(text), api_seconds(text), csi, *flow_control_waits(text))

    async def start(self) -> None:
        self._before = await self._read()

    async def stop(self, quiet_s: float = 2.0, limit_s: float = 60.0) -> None:
        """Takes the second reading once the writes have settled: no new POST, PUT, PATCH or DELETE
        for `quiet_s` (at most `limit_s`). A component that writes its events from a queue after
        the operation is done (client-go's broadcaster) is then counted as fully as one that
        writes them inline."""
        deadline = time.monotonic() + limit_s
        last = await self._read()
        while time.monotonic() < deadline:
            await asyncio.sleep(quiet_s)
            later = await self._read()
            if _writes(later.api) == _writes(last.api):
                break  # settled: the reading before the quiet spell is the count
            last = later
        self.served = last - self._before

    def figures(self, operations: int) -> dict[str, Any]:
        """Totals per operation (figures the method summarises) and the breakdowns behind them."""
        s = self.served
        return {
            "api_requests_per_op": round(sum(s.api.values()) / operations, 2),
            "csi_calls_per_op": round(sum(s.csi.values()) / operations, 2),
            "api_requests": per_op(s.api, operations),
            "csi_calls": per_op(s.csi, operations),
            "api_server_ms": {
                kind: round(1000 * s.api_s[kind] / s.api[kind], 1)
                for kind in per_op(s.api, operations)
                if not kind.startswith("WATCH")  # a watch lasts as long as its client keeps it
            },
            "flow_control_wait_ms": {
                level: round(1000 * s.waits_s[level] / n, 1) for level, n in s.waits.most_common() if n
            },
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
