"""The node sidecars' connection to a CSI driver on grpc_lite and threads: the two Identity calls
node-driver-registrar and livenessprobe make, each recorded in `csi_sidecar_operations_seconds`
as csi_client records a controller's calls, and the wait for the driver's name."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from . import csi_common
from .grpc_lite.client import Channel
from .grpc_lite.messages import Empty, GetPluginInfoResponse, ProbeResponse
from .grpc_lite.status import Code, RpcError
from .grpc_lite.wire import DecodeError

GET_PLUGIN_INFO = "/csi.v1.Identity/GetPluginInfo"
PROBE = "/csi.v1.Identity/Probe"

T = TypeVar("T")


@dataclass
class CSIClient:
    """Calls to the driver at `address` on one connection, made on the first call (the socket need
    not exist before); `timeout` bounds each call."""

    address: str
    timeout: float
    driver_name: str = ""  # labels the metric once known
    vendor_version: str = ""
    channel: Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = Channel(self.address)
        self.address = self.channel.path

    def __enter__(self) -> CSIClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _call(self, method: str, decode: Callable[[bytes], T]) -> T:
        start, code = time.perf_counter(), Code.OK
        try:
            response = self.channel.call(method, Empty().encode(), self.timeout)
            try:
                return decode(response)
            except DecodeError:
                raise RpcError(Code.INTERNAL, "Exception deserializing response!") from None  # grpcio's words
        except RpcError as e:
            code = e.code
            raise
        finally:
            csi_common.OPERATIONS.labels(self.driver_name, method, code.name).observe(
                time.perf_counter() - start
            )

    def probe(self) -> ProbeResponse:
        return self._call(PROBE, ProbeResponse.decode)

    def plugin_info(self) -> GetPluginInfoResponse:
        return self._call(GET_PLUGIN_INFO, GetPluginInfoResponse.decode)

    def wait_driver_name(self, stopping: threading.Event) -> str:
        """Asks GetPluginInfo until the driver answers (the socket may not exist yet, the driver may
        still be starting), as csi_client's wait_driver_name; an error the driver does answer with
        is raised. Returns early, with "", when `stopping` is set."""
        backoff = csi_common.Backoff(self.address, "not answering", None)
        while not stopping.is_set():
            try:
                info = self.plugin_info()
            except RpcError as exc:
                if exc.code.name not in csi_common.IN_PROGRESS:
                    raise
                stopping.wait(backoff.next_delay(f"{exc.code.name}: {exc.details}"))
                continue
            self.driver_name = csi_common.answered(self.address, info.name)
            self.vendor_version = info.vendor_version
            return self.driver_name
        return ""
