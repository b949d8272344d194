"""The CSI Identity service: who the plugin is, what it can do, and whether it is ready."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf.wrappers_pb2 import BoolValue

from controller_runtime.version import VERSION
from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc

from . import DRIVER_NAME
from .errors import failed_precondition
from .state import DriverState

Service = csi_pb2.PluginCapability.Service
Expansion = csi_pb2.PluginCapability.VolumeExpansion


class IdentityServer(csi_pb2_grpc.IdentityServicer):  # type: ignore[misc]
    def __init__(self, state: DriverState, controller: bool, name: str = DRIVER_NAME) -> None:
        self.state = state
        self.controller = controller
        self.name = name

    async def GetPluginInfo(
        self, req: csi_pb2.GetPluginInfoRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name=self.name, vendor_version=VERSION)

    async def GetPluginCapabilities(
        self, req: csi_pb2.GetPluginCapabilitiesRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.GetPluginCapabilitiesResponse:
        # The spec: every instance answers the same set, whichever services it serves itself (a
        # node-only instance is one part of a plugin that has a controller).
        caps = [
            csi_pb2.PluginCapability(service=Service(type=Service.VOLUME_ACCESSIBILITY_CONSTRAINTS)),
            csi_pb2.PluginCapability(service=Service(type=Service.CONTROLLER_SERVICE)),
            csi_pb2.PluginCapability(service=Service(type=Service.GROUP_CONTROLLER_SERVICE)),
            csi_pb2.PluginCapability(service=Service(type=Service.SNAPSHOT_METADATA_SERVICE)),
        ]
        caps += [
            csi_pb2.PluginCapability(volume_expansion=Expansion(type=Expansion.ONLINE)),
            csi_pb2.PluginCapability(volume_expansion=Expansion(type=Expansion.OFFLINE)),
        ]
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=caps)

    async def Probe(self, req: csi_pb2.ProbeRequest, _: grpc.aio.ServicerContext) -> csi_pb2.ProbeResponse:
        if self.state.ready and (problem := await asyncio.to_thread(self.state.pool_problem)):
            # The spec's "plugin is unhealthy": livenessprobe turns it into a failing /healthz.
            raise failed_precondition(problem)
        return csi_pb2.ProbeResponse(ready=BoolValue(value=self.state.ready))
