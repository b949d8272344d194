"""The kubelet plugin-registration API v1 on grpc_lite and threads, as node-driver-registrar
serves it, and what the CSI driver's in-process registration on grpcio
(controller_runtime.plugin_registration) shares with it: where the socket goes, the versions
offered, and what a status report from kubelet does.

kubelet finds `<driver>-reg.sock` in its plugins_registry directory, asks GetInfo, then reports
with NotifyRegistrationStatus whether registration worked; a refusal makes the process exit 1."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from .grpc_lite.messages import Empty, PluginInfo, RegistrationStatus
from .logs import get_logger
from .unix_sockets import SocketFile, socket_path

if TYPE_CHECKING:  # grpc_lite's server (h2) is imported when served: the CSI driver does without it
    from .grpc_lite.server import Server

log = get_logger("registration")

SUPPORTED_VERSIONS = ("1.0.0",)
SERVICE = "/pluginregistration.Registration/"


def registration_socket(directory: str, driver_name: str) -> str:
    """Where kubelet's plugin watcher looks for the driver: `<directory>/<driver>-reg.sock`."""
    return socket_path(os.path.join(directory, f"{driver_name}-reg.sock"))


class Registration:
    """The plugin as kubelet is told of it, and what kubelet said of it."""

    def __init__(self, driver_name: str, endpoint: str) -> None:
        self.driver_name = driver_name
        self.endpoint = endpoint  # the CSI socket path as kubelet sees it
        self.registered = False
        self.error = ""

    def info(self) -> PluginInfo:
        return PluginInfo("CSIPlugin", self.driver_name, self.endpoint, SUPPORTED_VERSIONS)

    def notified(self, registered: bool, error: str) -> bool:
        """Takes kubelet's report; True when it refused the plugin."""
        self.registered = registered
        if registered:
            log.info("kubelet registered the plugin", driver=self.driver_name, endpoint=self.endpoint)
            return False
        log.error("kubelet rejected the plugin registration", driver=self.driver_name, error=error)
        self.error = error or "no reason given"
        return True

    def refusal(self) -> RuntimeError:
        """Raised once kubelet refused the plugin, so the process exits non-zero and is restarted,
        as node-driver-registrar is (a plugin kubelet refused must not look healthy)."""
        return RuntimeError(f"kubelet refused the plugin registration: {self.error}")


class RegistrationServer(Registration):
    def __init__(self, driver_name: str, endpoint: str) -> None:
        super().__init__(driver_name, endpoint)
        self.refused = threading.Event()
        self._wake = threading.Event()  # kubelet refused the plugin, or the process is stopping
        self.server: Server | None = None

    def _get_info(self, request: bytes) -> bytes:
        Empty.decode(request)
        return self.info().encode()

    def _notify(self, request: bytes) -> bytes:
        status = RegistrationStatus.decode(request)
        if self.notified(status.plugin_registered, status.error):
            self.refused.set()
            self._wake.set()
        return Empty().encode()

    def serve(self, directory: str) -> SocketFile:
        """Serves this API on the driver's registration socket in kubelet's `directory`."""
        from .grpc_lite.server import Server

        self.server = Server(
            {f"{SERVICE}GetInfo": self._get_info, f"{SERVICE}NotifyRegistrationStatus": self._notify}
        )
        return self.server.start(registration_socket(directory, self.driver_name))

    def stop(self, grace: float) -> None:
        if self.server is not None:
            self.server.stop(grace)

    def wake(self) -> None:
        """Ends wait_refused without a refusal: the process is stopping."""
        self._wake.set()

    def wait_refused(self) -> None:
        """Waits for as long as kubelet accepts the plugin and `wake` is not called, and raises once
        kubelet reports failure."""
        self._wake.wait()
        if self.refused.is_set():
            raise self.refusal()
