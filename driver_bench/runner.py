"""Starting, killing and restarting a driver from its recipe.

Each service runs in a process group of its own, so kill -9 and the final stop reach whatever the
command started (a shell wrapper, a driver forking helpers). A service is ready when its socket
answers GetPluginInfo and Probe does not say "not ready": what a sidecar waits for. A command that
exits, never answers, or answers as something other than a CSI driver is a `RecipeError` that says
so, and nothing it started is left running."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc

from .recipe import Filled, Recipe, RecipeError, Service

NODE_ID = "bench-node"
LOG_TAIL = 3000


@dataclass(frozen=True)
class Layout:
    """Where one run of a driver keeps its things. `sockets` must be a short path: a unix socket's
    path may not exceed 107 bytes, and a test's work directory is often longer than that."""

    work: Path
    sockets: Path

    @property
    def state_dir(self) -> Path:
        return self.work / "state"

    @property
    def kubelet_dir(self) -> Path:
        return self.work / "kubelet"

    def socket(self, role: str) -> Path:
        return self.sockets / f"{role}.sock"

    def log(self, role: str) -> Path:
        return self.work / f"{role}.log"

    def make(self) -> None:
        for d in (self.work, self.sockets, self.state_dir, self.kubelet_dir):
            d.mkdir(parents=True, exist_ok=True)


def log_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-LOG_TAIL:].strip() or "(empty log)"


class ServiceProcess:
    """One service of the driver, started from its recipe command; restartable."""

    def __init__(
        self, recipe: Recipe, service: Service, layout: Layout, placeholders: Filled | None = None
    ) -> None:
        """`placeholders`: the values its command gets in place of the bench's own (the local
        stack's, when the fault proxy runs there, driver_bench/stack_plugin.py)."""
        self.recipe, self.service, self.layout = recipe, service, layout
        self.placeholders = placeholders
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    @property
    def socket(self) -> Path:
        return self.placeholders.socket if self.placeholders else self.layout.socket(self.service.role)

    def filled(self) -> Filled:
        if self.placeholders is not None:
            return self.placeholders
        return Filled(
            socket=self.socket,
            node_id=NODE_ID,
            state_dir=self.layout.state_dir,
            kubelet_dir=self.layout.kubelet_dir,
            recipe_dir=self.recipe.path.parent,
        )

    async def start(self) -> None:
        filled = self.filled()
        argv = self.recipe.argv(self.service, filled)
        env = {**os.environ, **self.recipe.environment(filled)}
        log = self.layout.log(self.service.role)
        with open(log, "ab") as out:  # noqa: ASYNC230 - a local file, appended once a start
            out.write(f"--- start {self.starts}: {' '.join(argv)}\n".encode())
            out.flush()
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    cwd=self.layout.work,
                    start_new_session=True,
                )
            except OSError as e:
                where = f"recipe {self.recipe.path}: {self.service.role}.command"
                raise RecipeError(f"{where}: cannot run {argv[0]!r}: {e.strerror}") from None
        self.starts += 1
        await self.wait_ready()

    async def wait_ready(self) -> None:
        proc = self.proc
        assert proc is not None
        where = f"recipe {self.recipe.path}: the {self.service.role} service ({self.socket})"
        await wait_ready(
            self.recipe, self.socket, where, lambda: proc.returncode, self.layout.log(self.service.role)
        )

    async def kill9(self) -> None:
        """kill -9 of the whole process group, as a node losing power or the OOM killer."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the group, SIGKILL after `grace`; then SIGKILL to whatever the group still
        holds, since a leader that exits may leave its children behind."""
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


ExitCode = Callable[[], int | None]


async def wait_ready(recipe: Recipe, socket: Path, where: str, exit_code: ExitCode, log: Path) -> None:
    """Waits for a service started from `recipe` to be ready on `socket`: GetPluginInfo answers
    (with the recipe's driver name, when it gives one) and Probe does not say "not ready", within
    the recipe's ready.timeout_seconds. `exit_code` is the process's, None while it runs; the
    bench's runner and the local stack (localstack/recipe_stack.py) both wait with it."""
    timeout = recipe.ready_timeout_seconds
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last = "its socket never appeared"
    while loop.time() < deadline:
        code = exit_code()
        if code is not None:
            raise RecipeError(
                f"{where} exited with status {code} before it was ready; its log ends:\n" + log_tail(log)
            )
        if socket.exists():  # noqa: ASYNC240 - one stat of a local socket per poll
            answer = await _probe(recipe, socket, where)
            if answer is None:
                return
            last = answer
        await asyncio.sleep(0.05)
    raise RecipeError(
        f"{where} never became ready within {timeout:g}s ({last}); its log ends:\n" + log_tail(log)
    )


async def _probe(recipe: Recipe, socket: Path, where: str) -> str | None:
    """None when ready; otherwise why not yet. Raises when the socket is not a CSI driver's."""
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        identity = csi_pb2_grpc.IdentityStub(channel)
        try:
            info = await identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=2)
            probe = await identity.Probe(csi_pb2.ProbeRequest(), timeout=2)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise RecipeError(
                    f"{where} answers, but not as a CSI driver: the Identity service is "
                    f"unimplemented ({e.details()})"
                ) from None
            return f"{e.code().name}: {e.details()}"
    if recipe.driver_name and info.name != recipe.driver_name:
        raise RecipeError(
            f"{where} reports the driver name {info.name!r}; the recipe says {recipe.driver_name!r}"
        )
    if probe.HasField("ready") and not probe.ready.value:
        return "Probe says not ready"
    return None


class Driver:
    """The driver's services from one recipe, on one layout."""

    def __init__(
        self, recipe: Recipe, layout: Layout, services: dict[str, ServiceProcess] | None = None
    ) -> None:
        """`services`: the processes to run in place of the recipe's (the local stack runs one
        service of the recipe per instance, driver_bench/stack_plugin.py)."""
        self.recipe, self.layout = recipe, layout
        self.services = services or {s.role: ServiceProcess(recipe, s, layout) for s in recipe.services}

    def role_of(self, method: str) -> str:
        """Which process serves a full gRPC method name (`/csi.v1.Node/NodeStageVolume`)."""
        if len(self.services) == 1:
            return next(iter(self.services))
        return "node" if "/csi.v1.Node/" in method and "node" in self.services else "controller"

    def socket(self, role: str) -> Path:
        return self.services[role if role in self.services else "controller"].socket

    async def start(self) -> None:
        self.layout.make()
        try:
            for service in self.services.values():
                await service.start()
        except BaseException:
            await self.stop()
            raise

    async def kill9(self, role: str) -> None:
        await self.services[role].kill9()

    async def restart(self, role: str) -> None:
        await self.services[role].kill9()
        await self.services[role].start()

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.services.values()))
