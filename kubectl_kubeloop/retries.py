"""What kubeloop's components are retrying about a claim's chain, from their read-only
`/debug/queues` (controller_runtime.debug): the failed key, its last error, its retries and when it
is tried next.

The components are found where they run: the local stack's launcher lists each one's HTTP endpoint
in `status.json` beside the admin kubeconfig; in a cluster, the pods labelled
`app.kubernetes.io/name=kubeloop` are read through the apiserver's pod proxy, on each container port
named `http...`. A component that cannot be read adds nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.resources import PODS


@dataclass
class Retry:
    component: str  # the local stack's instance name, or namespace/pod
    queue: str
    key: str
    error: str
    retries: int
    next_retry_in: float


async def _local(status_file: Path) -> dict[str, Any]:
    try:
        status = json.loads(await asyncio.to_thread(status_file.read_text))
    except (OSError, ValueError):
        return {}
    endpoints = {n: c.get("http_endpoint") for n, c in (status.get("components") or {}).items()}
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:

        async def one(name: str, endpoint: str) -> None:
            try:
                async with http.get(f"http://{endpoint}/debug/queues") as r:
                    if r.status == 200:
                        out[name] = await r.json()
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass

        await asyncio.gather(*(one(n, e) for n, e in endpoints.items() if e))
    return out


async def _in_cluster(api: ApiClient) -> dict[str, Any]:
    try:
        page = await api.list_page(PODS, None, labelSelector="app.kubernetes.io/name=kubeloop")
    except ApiError:
        return {}
    out: dict[str, Any] = {}

    async def one(pod: dict[str, Any], port: int) -> None:
        md = pod["metadata"]
        path = f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}:{port}/proxy/debug/queues"
        with contextlib.suppress(ApiError, aiohttp.ClientError, TimeoutError, ValueError):
            out[f"{md['namespace']}/{md['name']}:{port}"] = json.loads(await api.get_text(path, timeout=3))

    calls = [
        one(pod, p["containerPort"])
        for pod in page.get("items") or []
        if (pod.get("status") or {}).get("phase") == "Running"
        for c in (pod.get("spec") or {}).get("containers") or []
        for p in c.get("ports") or []
        if str(p.get("name", "")).startswith("http")
    ]
    await asyncio.gather(*calls)
    return out


async def gather(api: ApiClient, kubeconfig: str, keys: set[str]) -> list[Retry]:
    """The failing entries whose key is one of `keys` (claims and pods as namespace/name, PVs and
    VolumeAttachments by name), in every component that answers."""
    status_file = Path(kubeconfig).parent / "status.json" if kubeconfig else None
    found = await _local(status_file) if status_file is not None and status_file.exists() else {}
    if not found:
        found = await _in_cluster(api)
    out = []
    for component, doc in sorted(found.items()):
        for queue, entries in (doc.get("queues") or {}).items():
            for e in entries:
                if e.get("key") in keys:
                    out.append(
                        Retry(component, queue, e["key"], e.get("error", ""), int(e.get("retries", 0)),
                              float(e.get("next_retry_in", 0)))
                    )  # fmt: skip
    return out
