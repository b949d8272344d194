"""kubelet's volume metrics from the node agent, on the real stack: a claim's filesystem and block
volume in a pod show on the node's /metrics under kubelet's names and labels, the bytes written
counted, and the series goes with the pod."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from controller_runtime.client import ApiClient
from localstack.components import instances
from localstack.controlplane import ControlPlane
from localstack.storage_stack import StorageStack
from tests.support.waits import eventually_async

pytestmark = [pytest.mark.integration, pytest.mark.root]
MiB = 1 << 20


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(control_plane: ControlPlane, api: ApiClient) -> AsyncIterator[StorageStack]:
    s = StorageStack(control_plane, api)
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


async def node_metrics(stack: StorageStack, node: str) -> str:
    ports = {i.name: i.http_port for i in instances(stack.components.components, stack.components.nodes)}
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{ports[f'node-agent-{node}']}/metrics") as r,
    ):
        return await r.text()


def claim_series(text: str, namespace: str, claim: str) -> dict[str, float]:
    """The claim's kubelet_volume_stats_* samples by name (every series checked for its labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("kubelet_volume_stats_"):
            continue
        for sample in family.samples:
            assert set(sample.labels) == {"namespace", "persistentvolumeclaim"}, sample
            if sample.labels == {"namespace": namespace, "persistentvolumeclaim": claim}:
                out[sample.name] = sample.value
    return out


def write_blob(path: Path, size: int) -> None:
    with open(path / "blob", "wb") as f:
        f.write(os.urandom(size))
        os.fsync(f.fileno())


async def test_a_claims_usage_shows_on_the_nodes_metrics_as_kubelet_names_it(
    stack: StorageStack, namespace: str
) -> None:
    pvc, pv, handle = await stack.volume(namespace, size_mi=64)
    pod = await stack.pod(namespace, "writer", "node-a", pvc)
    await stack.wait_running(namespace, "writer")
    write_blob(stack.mount_path("node-a", pod, pv), 8 * MiB)

    async def counted() -> dict[str, float] | None:
        series = claim_series(await node_metrics(stack, "node-a"), namespace, pvc)
        return series if series.get("kubelet_volume_stats_used_bytes", 0) >= 8 * MiB else None

    series = await eventually_async("the 8 MiB written in kubelet_volume_stats_used_bytes", counted, 40)
    assert 50 * MiB < series["kubelet_volume_stats_capacity_bytes"] <= 64 * MiB
    assert (
        series["kubelet_volume_stats_available_bytes"]
        < series["kubelet_volume_stats_capacity_bytes"] - 8 * MiB
    )
    assert series["kubelet_volume_stats_inodes"] > series["kubelet_volume_stats_inodes_free"] > 0
    assert series["kubelet_volume_stats_inodes_used"] >= 1
    assert series["kubelet_volume_stats_health_status_abnormal"] == 0
    # Only node-a has it; and once the pod is gone, so is the series.
    assert claim_series(await node_metrics(stack, "node-b"), namespace, pvc) == {}
    text = await node_metrics(stack, "node-a")
    assert "# HELP kubelet_volume_stats_used_bytes [ALPHA] Number of used bytes in the volume" in text
    assert "# TYPE kubelet_volume_stats_used_bytes gauge" in text
    await stack.delete_pod(namespace, "writer")

    async def gone() -> bool:
        return claim_series(await node_metrics(stack, "node-a"), namespace, pvc) == {}

    await eventually_async("the claim's series gone with its pod", gone, 40)
    await stack.assert_clean(handle)
    await stack.delete_volume(namespace, pvc, pv, handle)


async def test_a_block_claim_reports_its_capacity_only(stack: StorageStack, namespace: str) -> None:
    pvc, pv, handle = await stack.volume(namespace, block=True, size_mi=32)
    await stack.pod(namespace, "blk", "node-b", pvc, block=True)
    await stack.wait_running(namespace, "blk")

    async def reported() -> dict[str, float] | None:
        series = claim_series(await node_metrics(stack, "node-b"), namespace, pvc)
        return series or None

    series = await eventually_async("the block claim's series", reported, 40)
    assert series["kubelet_volume_stats_capacity_bytes"] == 32 * MiB
    assert series["kubelet_volume_stats_used_bytes"] == series["kubelet_volume_stats_inodes"] == 0
    await stack.delete_pod(namespace, "blk")
    await stack.assert_clean(handle)
    await stack.delete_volume(namespace, pvc, pv, handle)
