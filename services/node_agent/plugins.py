"""Plugin registration, kubelet's plugin watcher and CSI plugin registration: asks every
`*-reg.sock` in plugins_registry for its CSI endpoint (pluginregistration v1 GetInfo, then
NotifyRegistrationStatus), connects, reads NodeGetInfo/NodeGetCapabilities, and records the driver
in the CSINode object and in the Node's node-id annotation and topology labels."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.csi_client import CSIConnection, error_text
from controller_runtime.logs import get_logger
from controller_runtime.resources import CSI_NODES, NODES, Obj
from controller_runtime.volumes import ANN_NODE_ID
from kubeloop_grpc.csi import csi_pb2
from kubeloop_grpc.pluginregistration import api_pb2, api_pb2_grpc

log = get_logger("node-agent")

NodeRPC = csi_pb2.NodeServiceCapability.RPC


@dataclass
class Plugin:
    name: str
    conn: CSIConnection
    node_id: str
    stage_unstage: bool
    single_node_multi_writer: bool
    topology: dict[str, str]
    max_volumes: int
    volume_stats: bool = False  # NodeGetVolumeStats (GET_VOLUME_STATS): kubelet's volume metrics


class PluginManager:
    """The registered CSI plugins of this node, by driver name."""

    def __init__(
        self, client: ApiClient, node_name: str, registry: Path, *, csi_timeout: float, rescan: float = 10.0
    ) -> None:
        self.client = client
        self.node_name = node_name
        self.registry = registry
        self.csi_timeout = csi_timeout
        self.rescan = rescan
        self._plugins: dict[str, Plugin] = {}

    @property
    def plugins(self) -> Mapping[str, Plugin]:
        return self._plugins

    async def discover(self) -> None:
        """Registers every plugin in the registry directory not registered yet."""
        registry = self.registry
        for sock in sorted(registry.glob("*-reg.sock")) if registry.is_dir() else []:
            try:
                await self._register_plugin(sock)
            except Exception as exc:
                log.warning("plugin registration failed", socket=str(sock), error=error_text(exc))

    async def watch(self) -> None:
        """Looks for new plugins every `rescan` seconds."""
        while True:
            await asyncio.sleep(self.rescan)
            await self.discover()

    async def close(self) -> None:
        for plugin in self._plugins.values():
            await plugin.conn.close()

    async def _register_plugin(self, sock: Path) -> None:
        async with grpc.aio.insecure_channel(f"unix:{sock}") as channel:
            stub = api_pb2_grpc.RegistrationStub(channel)
            info = await stub.GetInfo(api_pb2.InfoRequest(), timeout=5)
            if info.type != "CSIPlugin" or info.name in self._plugins:
                return
            try:
                plugin = await self._connect(info.name, info.endpoint)
                await self._write_csinode(plugin)
            except Exception as exc:
                await stub.NotifyRegistrationStatus(
                    api_pb2.RegistrationStatus(plugin_registered=False, error=error_text(exc)), timeout=5
                )
                raise
            await stub.NotifyRegistrationStatus(api_pb2.RegistrationStatus(plugin_registered=True), timeout=5)
        self._plugins[plugin.name] = plugin
        log.info("registered CSI plugin", driver=plugin.name, endpoint=info.endpoint, node_id=plugin.node_id)

    async def _connect(self, name: str, endpoint: str) -> Plugin:
        conn = await CSIConnection.connect(endpoint, timeout=self.csi_timeout, wait=30)
        try:
            info = await conn.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10)
            caps = await conn.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10)
        except BaseException:
            await conn.close()
            raise
        rpcs = {c.rpc.type for c in caps.capabilities if c.HasField("rpc")}
        topology = dict(info.accessible_topology.segments) if info.HasField("accessible_topology") else {}
        return Plugin(
            name=name,
            conn=conn,
            node_id=info.node_id,
            stage_unstage=NodeRPC.STAGE_UNSTAGE_VOLUME in rpcs,
            single_node_multi_writer=NodeRPC.SINGLE_NODE_MULTI_WRITER in rpcs,
            topology=topology,
            max_volumes=int(info.max_volumes_per_node),
            volume_stats=NodeRPC.GET_VOLUME_STATS in rpcs,
        )

    async def _write_csinode(self, plugin: Plugin) -> None:
        segments = plugin.topology
        node = await self.client.get(NODES, self.node_name)
        ids = json.loads((node["metadata"].get("annotations") or {}).get(ANN_NODE_ID) or "{}")
        ids[plugin.name] = plugin.node_id
        await self.client.patch(
            NODES,
            self.node_name,
            {"metadata": {"annotations": {ANN_NODE_ID: json.dumps(ids, sort_keys=True)}, "labels": segments}},
        )
        entry: Obj = {"name": plugin.name, "nodeID": plugin.node_id, "topologyKeys": sorted(segments) or None}
        if plugin.max_volumes > 0:
            entry["allocatable"] = {"count": plugin.max_volumes}
        owner = {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": node["metadata"]["uid"]}
        for _ in range(5):
            try:
                current = await self.client.get(CSI_NODES, self.node_name)
            except ApiError as exc:
                if not exc.not_found:
                    raise
                body = {
                    "metadata": {"name": self.node_name, "ownerReferences": [owner]},
                    "spec": {"drivers": [entry]},
                }
                try:
                    await self.client.create(CSI_NODES, body)
                    return
                except ApiError as create_exc:
                    if create_exc.conflict:
                        continue
                    raise
            fresh = copy.deepcopy(current)
            drivers = [d for d in fresh["spec"].get("drivers") or [] if d.get("name") != plugin.name]
            fresh["spec"]["drivers"] = [*drivers, entry]
            try:
                await self.client.update(CSI_NODES, fresh)
                return
            except ApiError as exc:
                if not exc.conflict:
                    raise
        raise RuntimeError("CSINode kept changing under us")
