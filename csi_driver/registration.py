"""The kubelet plugin-registration API v1: kubelet finds `<driver>-reg.sock` in its
plugins_registry directory, asks GetInfo, then reports whether registration worked."""

from __future__ import annotations

import asyncio

import grpc

from controller_runtime.logs import get_logger
from kubeloop_grpc.pluginregistration import api_pb2, api_pb2_grpc

from . import DRIVER_NAME

log = get_logger("csi.registration")


class RegistrationServer(api_pb2_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint  # the CSI socket path as kubelet sees it
        self.registered = False
        self.refused = asyncio.Event()  # set when kubelet reports failure: the process exits 1
        self.error = ""

    async def GetInfo(self, req: api_pb2.InfoRequest, _: grpc.aio.ServicerContext) -> api_pb2.PluginInfo:
        return api_pb2.PluginInfo(
            type="CSIPlugin", name=DRIVER_NAME, endpoint=self.endpoint, supported_versions=["1.0.0"]
        )

    async def NotifyRegistrationStatus(
        self, req: api_pb2.RegistrationStatus, _: grpc.aio.ServicerContext
    ) -> api_pb2.RegistrationStatusResponse:
        self.registered = req.plugin_registered
        if req.plugin_registered:
            log.info("kubelet registered the plugin", driver=DRIVER_NAME, endpoint=self.endpoint)
        else:
            log.error("kubelet rejected the plugin registration", driver=DRIVER_NAME, error=req.error)
            self.error = req.error or "no reason given"
            self.refused.set()
        return api_pb2.RegistrationStatusResponse()
