"""The sidecars' connection to a CSI driver over its unix socket.

`CSIConnection.connect` waits until the socket exists and the driver's Probe says ready (logging
while it waits, as the Go sidecars do), then reads the driver's name and capabilities once. Every
call made through the stubs should pass `timeout=conn.timeout`; each call's latency and gRPC code
are recorded in `csi_sidecar_operations_seconds`, the upstream metric.

`SidecarController` (controller_runtime.sidecar_controller, importable from here) and
`SidecarOptions` are what the external-attacher's and external-resizer's
controllers share: the connection and driver name, and the workers, CSI timeout and retry backoff.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc

from . import csi_common
from .csi_errors import IN_PROGRESS_CODES
from .grpc_lite.aio import Channel
from .grpc_lite.status import go_name
from .logs import get_logger
from .unix_grpc import socket_path

if TYPE_CHECKING:
    from .sidecar_controller import SidecarController as SidecarController

StubT = TypeVar("StubT")
log = get_logger("csi")


def error_text(exc: BaseException) -> str:
    """An error worded as a Go client prints it (`rpc error: code = NotFound desc = ...`), which
    is what users search for; anything other than a gRPC error as its own text."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"rpc error: code = {go_code(exc.code())} desc = {exc.details()}"
    return str(exc) or type(exc).__name__


def go_code(code: grpc.StatusCode) -> str:
    """A gRPC code as Go's codes.Code prints it (`InvalidArgument`, `Canceled`)."""
    return go_name(code.name)


def probe_ready(response: csi_pb2.ProbeResponse) -> bool:
    """A Probe answer means ready unless it says `ready: false` (an unset field is ready)."""
    return not response.HasField("ready") or bool(response.ready.value)


class _Metered:
    """One RPC of a stub, with its latency and gRPC code observed in csi_sidecar_operations_seconds
    (labels as upstream's: driver, `/csi.v1.Controller/CreateVolume`, `OK`). A wrapper, not a
    grpc.aio interceptor: an intercepted call is a second call object and a second task, about 30
    us of client CPU per call (a CreateVolume cost the provisioner 270 us with it, 240 without,
    measured with 50 calls in flight)."""

    __slots__ = ("_call", "_conn", "_method")

    def __init__(self, call: Callable[..., Awaitable[Any]], method: str, conn: CSIConnection) -> None:
        self._call = call
        self._method = method
        self._conn = conn

    async def __call__(self, request: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return await self._call(request, **kwargs)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            raise
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED  # Go's context.Canceled
            raise
        finally:
            csi_common.OPERATIONS.labels(self._conn.driver_name, self._method, code.name).observe(
                time.perf_counter() - start
            )


@dataclass
class CSIConnection:
    address: str
    timeout: float
    channel: Channel
    driver_name: str = ""
    vendor_version: str = ""
    plugin_capabilities: set[int] = field(default_factory=set)
    controller_capabilities: set[int] = field(default_factory=set)
    # The stubs, each made once: a stub builds a callable for every RPC of its service, and the
    # properties below are read for every call (1.4 % of the provisioner's busy samples over
    # 1,000 claims when each read made a ControllerStub).
    _stubs: dict[type, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    async def __aenter__(self) -> CSIConnection:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    def _stub(self, kind: type[StubT]) -> StubT:
        stub: StubT | None = self._stubs.get(kind)
        if stub is None:
            stub = self._stubs[kind] = kind(self.channel)  # type: ignore[call-arg]
            service = csi_pb2.DESCRIPTOR.services_by_name[kind.__name__.removesuffix("Stub")].full_name
            for name, call in vars(stub).items():
                setattr(stub, name, _Metered(call, f"/{service}/{name}", self))
        return stub

    @property
    def identity(self) -> csi_pb2_grpc.IdentityStub:
        return self._stub(csi_pb2_grpc.IdentityStub)

    @property
    def controller(self) -> csi_pb2_grpc.ControllerStub:
        return self._stub(csi_pb2_grpc.ControllerStub)

    @property
    def node(self) -> csi_pb2_grpc.NodeStub:
        return self._stub(csi_pb2_grpc.NodeStub)

    def has_controller_capability(self, rpc_type: int) -> bool:
        return rpc_type in self.controller_capabilities

    def has_plugin_capability(self, service_type: int) -> bool:
        return service_type in self.plugin_capabilities

    @classmethod
    def open(cls, address: str, timeout: float = 10.0) -> CSIConnection:
        """A connection that has not talked to the driver yet: the channel connects on its first
        call, so the socket need not exist yet."""
        path = socket_path(address)
        return cls(
            address=path,
            timeout=timeout,
            channel=Channel(path),
        )

    @classmethod
    async def connect(cls, address: str, timeout: float = 10.0, wait: float | None = None) -> CSIConnection:
        """Connects and waits (forever when wait is None) until the driver answers Probe ready."""
        conn = cls.open(address, timeout)

        async def ready() -> str | None:
            try:
                probe = await conn.identity.Probe(csi_pb2.ProbeRequest(), timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"
            return None if probe_ready(probe) else "driver reports not ready"

        try:
            await conn._wait("not ready", ready, wait)
            await conn._read_capabilities()
        except BaseException:
            await conn.close()
            raise
        log.info(
            "connected to CSI driver",
            address=conn.address,
            driver=conn.driver_name,
            version=conn.vendor_version,
        )
        return conn

    async def wait_driver_name(self) -> str:
        """Asks GetPluginInfo until the driver answers (the socket may not exist yet, the driver may
        still be starting), as node-driver-registrar and livenessprobe learn the name; an error
        the driver does answer with is raised."""

        async def answered() -> str | None:
            try:
                info = await self.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=self.timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in IN_PROGRESS_CODES:
                    raise
                return f"{exc.code().name}: {exc.details()}"
            self.driver_name = csi_common.answered(self.address, info.name)
            self.vendor_version = info.vendor_version
            return None

        await self._wait("not answering", answered, None)
        return self.driver_name

    async def _wait(
        self, state: str, attempt: Callable[[], Awaitable[str | None]], wait: float | None
    ) -> None:
        """Calls `attempt` until it returns None, backing off from 0.1 s to 2 s and saying every
        10 s why it still waits (what it returned); gives up after `wait` seconds unless None."""
        backoff = csi_common.Backoff(self.address, state, wait)
        while (reason := await attempt()) is not None:
            delay = backoff.next_delay(reason)
            await asyncio.sleep(delay)

    async def _read_capabilities(self) -> None:
        info = await self.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=self.timeout)
        self.driver_name, self.vendor_version = info.name, info.vendor_version
        caps = await self.identity.GetPluginCapabilities(
            csi_pb2.GetPluginCapabilitiesRequest(), timeout=self.timeout
        )
        self.plugin_capabilities = {c.service.type for c in caps.capabilities if c.HasField("service")}
        if csi_pb2.PluginCapability.Service.CONTROLLER_SERVICE in self.plugin_capabilities:
            try:
                ccaps = await self.controller.ControllerGetCapabilities(
                    csi_pb2.ControllerGetCapabilitiesRequest(), timeout=self.timeout
                )
            except grpc.aio.AioRpcError as e:
                # CONTROLLER_SERVICE is the plugin's as a whole: a node-only instance reports it
                # and serves no Controller RPC. Its controller capabilities are none.
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self.controller_capabilities = set()
            else:
                self.controller_capabilities = {c.rpc.type for c in ccaps.capabilities if c.HasField("rpc")}

    async def close(self) -> None:
        await self.channel.close()


@dataclass(frozen=True)
class SidecarOptions:
    """What tunes every CSI sidecar's controller: its workers, the timeout of each CSI call, and the
    per-object retry backoff (--retry-interval-start doubling to --retry-interval-max)."""

    workers: int = 10
    timeout: float = 10.0
    retry_start: float = 1.0
    retry_max: float = 300.0


def __getattr__(name: str) -> Any:
    # SidecarController lives in controller_runtime.sidecar_controller and is imported from here
    # only when asked for: its base, the informer controller, brings the API client (its
    # transport, yaml) into processes that never talk to an apiserver (node-driver-registrar,
    # livenessprobe).
    if name == "SidecarController":
        from .sidecar_controller import SidecarController

        return SidecarController
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
