"""The interposing CSI proxy: a gRPC server on a unix socket between the caller and the driver's
sockets, generic over methods (raw bytes in and out, so it serves any CSI version and any method,
the caller's and the driver's own), which records every call and injects the scenario's fault.

Calls are routed by service: Node methods to the node process when the recipe has one, the rest to
the controller's. While a killed service restarts, calls for it wait, as a sidecar's calls wait for
a driver's socket to come back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from .faults import Fault, FaultKind, step_of
from .recipe import RecipeError
from .runner import Driver


@dataclass
class Call:
    """One call the caller made through the proxy, as the proxy saw it."""

    seq: int
    method: str  # full gRPC name
    request: bytes
    started: float  # seconds since the proxy started
    code: str = "OK"
    details: str = ""
    response: bytes | None = None  # the driver's answer, when it gave one (even if dropped)
    seconds: float = 0.0  # the driver's time, for the report's timings
    fault: str = ""  # what the proxy did to this call, if anything
    extra: dict[str, Any] = field(default_factory=dict)


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class FaultProxy:
    """The proxy of one scenario: `fault` fires once, at the `occurrence`-th call of its step;
    `calls` is every call the caller made, for the oracles, the reproducer and the timings. Its
    socket lives in the scenario's private (0700) socket directory."""

    def __init__(
        self,
        driver: Driver,
        socket: Path,
        fault: Fault | None,
        timeout_seconds: float = 0.1,
        on_call: Callable[[Call], None] | None = None,
    ) -> None:
        """`on_call` is told of each call once it has ended (the local stack's proxies write them
        down for the stack campaign, which runs in another process)."""
        self.driver, self.socket, self.fault = driver, socket, fault
        self.timeout_seconds = timeout_seconds
        self.on_call = on_call
        self.calls: list[Call] = []
        self.counts: dict[str, int] = {}  # calls so far per lifecycle step
        self.fired: Call | None = None
        self.restart_error: RecipeError | None = None
        # Set while a service serves; cleared from its kill -9 until its restart is ready.
        self._serving = {role: asyncio.Event() for role in driver.services}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._retired: list[grpc.aio.Channel] = []
        self._server: grpc.aio.Server | None = None
        self._t0 = time.monotonic()
        # The wall clock at _t0: the calls of several proxies (one per stack instance) are put in
        # one order by it.
        self.wall_t0 = time.time()
        self._tasks: set[asyncio.Task[None]] = set()
        for event in self._serving.values():
            event.set()

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    async def start(self) -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_Generic(self._handle),))
        server.add_insecure_port(self.endpoint)
        await server.start()
        self._server = server

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(grace=None)
        for channel in [*self._channels.values(), *self._retired]:
            await channel.close()
        self._channels.clear()
        self._retired.clear()

    async def settle(self) -> None:
        """Waits for every restart the fault started (the oracles judge a running driver)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _channel(self, role: str) -> grpc.aio.Channel:
        if role not in self._channels:
            self._channels[role] = grpc.aio.insecure_channel(f"unix://{self.driver.socket(role)}")
        return self._channels[role]

    async def _forward(self, method: str, request: bytes, timeout: float | None = None) -> bytes:
        role = self.driver.role_of(method)
        await self._serving[role].wait()
        if self.restart_error is not None:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, f"the driver did not restart: {self.restart_error}")
        call: Callable[..., Any] = self._channel(role).unary_unary(method)
        try:
            return bytes(await call(request, timeout=timeout))
        except grpc.aio.AioRpcError as e:
            raise _Abort(e.code(), e.details() or "") from None

    def _restart(self, role: str) -> None:
        """kill -9 now; the restart runs on while the caller hears of the broken connection."""
        self._serving[role].clear()

        async def run() -> None:
            try:
                # The old channel is retired, not closed: closing it would cancel the calls still
                # on it locally, and a cancelled call's handler answers the caller nothing (it
                # waits out its deadline); the dead socket fails them UNAVAILABLE, as it would
                # fail a sidecar's.
                channel = self._channels.pop(role, None)
                if channel is not None:
                    self._retired.append(channel)
                await self.driver.restart(role)
            except RecipeError as e:
                self.restart_error = e
            finally:
                self._serving[role].set()

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(
        self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes], method: str
    ) -> bytes:
        step = step_of(method, request)
        count = self.counts[step] = self.counts.get(step, 0) + 1
        call = Call(len(self.calls), method, request, time.monotonic() - self._t0)
        self.calls.append(call)
        fault = self.fault
        firing = (
            fault is not None and self.fired is None and step == fault.method and count == fault.occurrence
        )
        if firing:
            self.fired = call
            call.fault = str(fault)
        start = time.monotonic()
        try:
            if firing:
                assert fault is not None
                answer = await self._inject(fault.kind, call)
            else:
                answer = await self._forward(method, request)
            call.response = answer
            return answer
        except _Abort as e:
            call.code, call.details = e.code.name, e.details
            await context.abort(e.code, e.details)
            raise  # unreachable: abort raises
        finally:
            call.seconds = time.monotonic() - start
            if self.on_call is not None:
                self.on_call(call)

    async def _inject(self, kind: FaultKind, call: Call) -> bytes:
        role = self.driver.role_of(call.method)
        if kind is FaultKind.KILL_BEFORE:
            await self.driver.kill9(role)
            self._restart(role)
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "bench: the driver was killed (-9) before the call")
        if kind is FaultKind.TIMEOUT:
            # The deadline travels with the call, so the driver sees it expire (a Go driver's
            # context is cancelled, a grpc.aio handler is cancelled); whatever it answers, the
            # caller has given up by then.
            with contextlib.suppress(_Abort):
                call.response = await self._forward(call.method, call.request, timeout=self.timeout_seconds)
            raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "bench: the caller's deadline expired")
        if kind is FaultKind.DUPLICATE:
            first, second = await asyncio.gather(
                self._forward(call.method, call.request),
                self._forward(call.method, call.request),
                return_exceptions=True,
            )
            call.extra["second"] = "OK" if isinstance(second, bytes) else str(second)
            if isinstance(first, BaseException):
                raise first
            return first
        answer = await self._forward(call.method, call.request)
        call.response = answer
        if kind is FaultKind.KILL_AFTER:
            await self.driver.kill9(role)
            self._restart(role)
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "bench: the driver was killed (-9) after it answered")
        raise _Abort(grpc.StatusCode.UNAVAILABLE, "bench: the answer was dropped")


class _Generic(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc has no type hints
    """Every method, as bytes: no (de)serializers, so the proxy never needs to know the types."""

    def __init__(self, handle: Callable[..., Any]) -> None:
        self._handle = handle

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = str(details.method)

        async def unary(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            answer: bytes = await self._handle(request, context, method)
            return answer

        return grpc.unary_unary_rpc_method_handler(unary)
