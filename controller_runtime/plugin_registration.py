"""The kubelet plugin-registration API v1, as a CSI plugin answers it: kubelet finds
`<driver>-reg.sock` in its plugins_registry directory, asks GetInfo, then reports whether
registration worked. The driver serves it in process (--kubelet-registration-dir) and
kubeloop-node-driver-registrar serves it for a driver in another container."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

import grpc

from kubeloop_grpc.pluginregistration import api_pb2, api_pb2_grpc

from .logs import get_logger
from .unix_grpc import UnixServer, socket_path, start_unix_server

log = get_logger("registration")

SUPPORTED_VERSIONS = ("1.0.0",)


def registration_socket(directory: str, driver_name: str) -> str:
    """Where kubelet's plugin watcher looks for the driver: `<directory>/<driver>-reg.sock`."""
    return socket_path(os.path.join(directory, f"{driver_name}-reg.sock"))


class RegistrationServer(api_pb2_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, driver_name: str, endpoint: str) -> None:
        self.driver_name = driver_name
        self.endpoint = endpoint  # the CSI socket path as kubelet sees it
        self.registered = False
        self.refused = asyncio.Event()  # set when kubelet reports failure: the process exits 1
        self.error = ""

    async def GetInfo(self, req: api_pb2.InfoRequest, _: grpc.aio.ServicerContext) -> api_pb2.PluginInfo:
        return api_pb2.PluginInfo(
            type="CSIPlugin",
            name=self.driver_name,
            endpoint=self.endpoint,
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    async def NotifyRegistrationStatus(
        self, req: api_pb2.RegistrationStatus, _: grpc.aio.ServicerContext
    ) -> api_pb2.RegistrationStatusResponse:
        self.registered = req.plugin_registered
        if req.plugin_registered:
            log.info("kubelet registered the plugin", driver=self.driver_name, endpoint=self.endpoint)
        else:
            log.error("kubelet rejected the plugin registration", driver=self.driver_name, error=req.error)
            self.error = req.error or "no reason given"
            self.refused.set()
        return api_pb2.RegistrationStatusResponse()

    async def serve(
        self, directory: str, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
    ) -> UnixServer:
        """Serves this API on the driver's registration socket in kubelet's `directory`."""
        path = registration_socket(directory, self.driver_name)
        return await start_unix_server(
            path, lambda s: api_pb2_grpc.add_RegistrationServicer_to_server(self, s), interceptors
        )

    async def wait_refused(self) -> None:
        """Waits for as long as kubelet accepts the plugin, and raises once it reports failure, so
        the process exits non-zero and is restarted, as node-driver-registrar is (a plugin kubelet
        refused must not look healthy)."""
        await self.refused.wait()
        raise RuntimeError(f"kubelet refused the plugin registration: {self.error}")
