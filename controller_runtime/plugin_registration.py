"""The kubelet plugin-registration API v1, as a CSI plugin answers it: kubelet finds
`<driver>-reg.sock` in its plugins_registry directory, asks GetInfo, then reports whether
registration worked. The driver serves it in process (--kubelet-registration-dir) on grpcio, here;
kubeloop-node-driver-registrar serves it for a driver in another container on grpc_lite
(controller_runtime.registration_lite, which holds what both share)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from kubeloop_grpc.pluginregistration import api_pb2, api_pb2_grpc

from .registration_lite import SUPPORTED_VERSIONS, Registration, registration_socket
from .unix_grpc import UnixServer, start_unix_server

__all__ = ["SUPPORTED_VERSIONS", "RegistrationServer", "registration_socket"]


class RegistrationServer(Registration, api_pb2_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, driver_name: str, endpoint: str) -> None:
        super().__init__(driver_name, endpoint)
        self.refused = asyncio.Event()  # set when kubelet reports failure: the process exits 1

    async def GetInfo(self, req: api_pb2.InfoRequest, _: grpc.aio.ServicerContext) -> api_pb2.PluginInfo:
        info = self.info()
        return api_pb2.PluginInfo(
            type=info.type,
            name=info.name,
            endpoint=info.endpoint,
            supported_versions=list(info.supported_versions),
        )

    async def NotifyRegistrationStatus(
        self, req: api_pb2.RegistrationStatus, _: grpc.aio.ServicerContext
    ) -> api_pb2.RegistrationStatusResponse:
        if self.notified(req.plugin_registered, req.error):
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
        the process exits non-zero and is restarted."""
        await self.refused.wait()
        raise self.refusal()
