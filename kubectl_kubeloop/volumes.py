"""`kubectl kubeloop get volumes`: every PersistentVolume on one line, across the objects that say
where it is (VolumeAttachments, the nodes' volumesInUse) and what its node measures (the kubelet's,
or the node agent's, kubelet_volume_stats_* on /metrics)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.kinds import Node, node_view, pv_view, volume_attachment_view
from controller_runtime.quantity import format_quantity
from controller_runtime.resources import NODES, PERSISTENT_VOLUMES, VOLUME_ATTACHMENTS
from controller_runtime.volumes import ANN_METRICS_URL, unique_volume_name

ClaimKey = tuple[str, str]


@dataclass
class Row:
    volume: str
    claim: str  # namespace/name, "" when unbound
    driver: str
    size: str
    status: str  # the PV's phase
    attached: list[str]  # nodes with an attached VolumeAttachment
    in_use: list[str]  # nodes reporting it in volumesInUse (wanted by a pod there: mounted or about to be)
    used_bytes: int | None  # from the node's stats, None when no node measures it
    health: str  # ok / abnormal / - (no condition reported)


async def _node_metrics(api: ApiClient, node: Node) -> str:
    url = (node["metadata"].get("annotations") or {}).get(ANN_METRICS_URL)
    try:
        if url:
            async with aiohttp.ClientSession() as http, http.get(url, timeout=aiohttp.ClientTimeout(5)) as r:
                return await r.text()
        return await api.get_text(f"/api/v1/nodes/{node['metadata']['name']}/proxy/metrics", timeout=5)
    except (ApiError, aiohttp.ClientError, TimeoutError):
        return ""  # a node that cannot be read measures nothing


def _stats(texts: list[str]) -> tuple[dict[ClaimKey, int], dict[ClaimKey, bool]]:
    used: dict[ClaimKey, int] = {}
    abnormal: dict[ClaimKey, bool] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = (s.labels.get("namespace", ""), s.labels.get("persistentvolumeclaim", ""))
                if s.name == "kubelet_volume_stats_used_bytes":
                    used[key] = int(s.value)
                elif s.name == "kubelet_volume_stats_health_status_abnormal":
                    abnormal[key] = bool(s.value)
    return used, abnormal


async def rows(api: ApiClient) -> list[Row]:
    (pv_objs, _), (va_objs, _), (node_objs, _) = await asyncio.gather(
        api.list_all(PERSISTENT_VOLUMES), api.list_all(VOLUME_ATTACHMENTS), api.list_all(NODES)
    )
    pvs, vas = [pv_view(p) for p in pv_objs], [volume_attachment_view(va) for va in va_objs]
    nodes = [node_view(n) for n in node_objs]
    used, abnormal = _stats(list(await asyncio.gather(*(_node_metrics(api, n) for n in nodes))))
    in_use = {n["metadata"]["name"]: set((n.get("status") or {}).get("volumesInUse") or []) for n in nodes}
    out = []
    for pv in sorted(pvs, key=lambda p: p["metadata"]["name"]):
        spec = pv.get("spec") or {}
        csi = spec.get("csi") or {}
        ref = spec.get("claimRef") or {}
        key = (str(ref.get("namespace", "")), str(ref.get("name", "")))
        name = pv["metadata"]["name"]
        unique = unique_volume_name(csi.get("driver", ""), csi.get("volumeHandle", "")) if csi else ""
        health = "-" if key not in abnormal else ("abnormal" if abnormal[key] else "ok")
        out.append(
            Row(
                volume=name,
                claim=f"{key[0]}/{key[1]}" if key[1] else "",
                driver=str(csi.get("driver", "")),
                size=str((spec.get("capacity") or {}).get("storage", "")),
                status=str((pv.get("status") or {}).get("phase", "")),
                attached=sorted(
                    va["spec"]["nodeName"]
                    for va in vas
                    if va["spec"].get("source", {}).get("persistentVolumeName") == name
                    and (va.get("status") or {}).get("attached")
                ),
                in_use=sorted(n for n, names in in_use.items() if unique and unique in names),
                used_bytes=used.get(key),
                health=health,
            )
        )
    return out


def table(rows: list[Row]) -> str:
    header = ("VOLUME", "CLAIM", "STATUS", "SIZE", "USED", "ATTACHED", "IN USE", "HEALTH", "DRIVER")
    lines = [header]
    for r in rows:
        lines.append(
            (
                r.volume, r.claim or "<none>", r.status, r.size,
                format_quantity(r.used_bytes) if r.used_bytes is not None else "-",
                ",".join(r.attached) or "-", ",".join(r.in_use) or "-", r.health, r.driver or "-",
            )
        )  # fmt: skip
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    return "".join(
        "   ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() + "\n"
        for line in lines
    )
