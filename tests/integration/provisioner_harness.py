"""Shared pieces of the external-provisioner integration tests (no tests here): a harness that runs
the real CSI driver (`--mode controller`, on a temporary pool), the pv-controller in-process and
the provisioner as a subprocess under its own RBAC identity, so a test can SIGKILL and restart it.

`backing_files()` and `pv_handles()` are the two sides of the invariant every fault test ends on:
after recovery, the volumes in the pool are exactly the volumes the PVs name."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.controller import ControllerContext
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.resources import (
    EVENTS,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    STORAGE_CLASSES,
    Obj,
)
from controller_runtime.toolchain import REPO_ROOT
from csi_driver import DRIVER_NAME
from external_provisioner.names import CLONE_FINALIZER
from localstack.certs import service_account_identity
from localstack.controlplane import ControlPlane
from localstack.proc import free_ports
from services.pv_controller import names as pv_names
from services.pv_controller.controller import Options as PVOptions
from services.pv_controller.controller import PVController
from tests.csi.conftest import Driver
from tests.support.waits import eventually_async, no_problems
from tests.support.writes import until_written

IDENTITY = service_account_identity("kubeloop-external-provisioner")


async def kubectl(cp: ControlPlane, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        str(cp.toolchain.binary("kubectl")),
        f"--kubeconfig={cp.admin_kubeconfig}",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()
    return out.decode()


async def terminate(proc: asyncio.subprocess.Process | None) -> None:
    """SIGTERM to a provisioner process still running, SIGKILL if it has not ended 15 s later."""
    if proc is not None and proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()


class Harness:
    def __init__(self, cp: ControlPlane, api: ApiClient, namespace: str) -> None:
        self.cp, self.api, self.ns = cp, api, namespace
        # Short: the driver's socket path may not exceed 107 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="kp", dir="/tmp"))
        self.driver: Driver | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.log = self.root / "provisioner.log"
        self.classes: list[str] = []
        self._pv_task: asyncio.Task[None] | None = None
        self._pv_client: ApiClient | None = None
        self._pv_recorder: EventRecorder | None = None
        # The RBAC applied for the provisioner, and the identity it runs as (kubeloop's by default).
        self.rbac = REPO_ROOT / "deploy/rbac/external-provisioner.yaml"
        self.kubeconfig: Path | None = None

    # -- processes ---------------------------------------------------------------------------------

    def start_driver(self, *extra: str) -> Driver:
        self.driver = Driver(self.root, "controller", "node-a", extra).start()
        return self.driver

    async def start_pv_controller(self) -> None:
        self._pv_client = await ApiClient.from_kubeconfig(str(self.cp.admin_kubeconfig), qps=0, burst=1)
        self._pv_recorder = EventRecorder(self._pv_client, pv_names.COMPONENT)
        factory = SharedInformerFactory(self._pv_client, resync_period=2.0)
        context = ControllerContext(self._pv_client, factory, self._pv_recorder)
        controller = PVController(context, PVOptions(resync_period=2.0))
        self._pv_task = asyncio.create_task(controller.run())
        await asyncio.wait_for(factory.wait_for_sync(), 30)

    async def start_provisioner(
        self, *extra: str, failpoints: Sequence[str] = (), wait_ready: bool = True
    ) -> asyncio.subprocess.Process:
        assert self.driver is not None
        await kubectl(self.cp, "apply", "-f", str(self.rbac))
        (port,) = free_ports(1)
        self.port = port
        # Failpoints exist only in the test-only entry module; the shipped one cannot arm them.
        entry = (
            ["tests.integration.provisioner_failpoints", f"--failpoints={','.join(failpoints)}"]
            if failpoints
            else ["external_provisioner.main"]
        )
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            *entry,
            f"--kubeconfig={self.kubeconfig or self.cp.kubeconfig_for(IDENTITY)}",
            f"--csi-address={self.driver.endpoint}",
            f"--state-dir={self.root / 'provisioner'}",
            f"--http-endpoint=127.0.0.1:{port}",
            "--retry-interval-start=100ms",
            "--retry-interval-max=1s",
            "--kube-api-qps=100",
            "--kube-api-burst=200",
            "-v=4",
            *extra,
            cwd=REPO_ROOT,
            stdout=self.log.open("ab"),
            stderr=asyncio.subprocess.STDOUT,
        )
        if wait_ready:
            await self.wait_ready()
        return self.proc

    async def wait_ready(self, timeout: float = 30) -> None:
        """Until /readyz answers 200: connected to the driver, caches synced."""
        url = f"http://127.0.0.1:{self.port}/readyz"
        async with aiohttp.ClientSession() as session:

            async def ready() -> bool:
                assert self.proc is not None
                if self.proc.returncode is not None:
                    return True  # exited (a failpoint can fire before readiness is seen)
                async with session.get(url) as rsp:
                    return rsp.status == 200

            await eventually_async(
                "the provisioner's /readyz to answer 200",
                ready,
                timeout,
                ignoring=(aiohttp.ClientError,),
                context=self.log_tail,
            )

    async def wait_exit(self, timeout: float = 30) -> int:
        assert self.proc is not None
        return await asyncio.wait_for(self.proc.wait(), timeout)

    async def stop_provisioner(self) -> None:
        await terminate(self.proc)
        self.proc = None

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log.exists() else ""

    # -- objects -----------------------------------------------------------------------------------

    def cls(self, short: str) -> str:
        return f"{self.ns}-{short}"

    async def create_class(self, short: str, **spec: object) -> str:
        name = self.cls(short)
        body: Obj = {"metadata": {"name": name}, "provisioner": DRIVER_NAME, **spec}
        await self.api.create(STORAGE_CLASSES, body)
        self.classes.append(name)
        return name

    async def create_pvc(
        self,
        name: str,
        size: str = "64Mi",
        cls: str | None = None,
        *,
        modes: Sequence[str] = ("ReadWriteOnce",),
        block: bool = False,
        data_source: Obj | None = None,
        annotations: dict[str, str] | None = None,
    ) -> Obj:
        spec: Obj = {"accessModes": list(modes), "resources": {"requests": {"storage": size}}}
        if cls is not None:
            spec["storageClassName"] = cls
        if block:
            spec["volumeMode"] = "Block"
        if data_source is not None:
            spec["dataSource"] = data_source
        body = {"metadata": {"name": name, "annotations": annotations or {}}, "spec": spec}
        return await self.api.create(PERSISTENT_VOLUME_CLAIMS, body, self.ns)

    async def pvc(self, name: str) -> Obj | None:
        try:
            return await self.api.get(PERSISTENT_VOLUME_CLAIMS, name, self.ns)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def pvs(self) -> list[Obj]:
        """This test's PVs: provisioned by the driver for claims of this namespace."""
        items = (await self.api.list_page(PERSISTENT_VOLUMES))["items"]
        return [
            p
            for p in items
            if (p["spec"].get("claimRef") or {}).get("namespace") == self.ns
            and p["spec"].get("csi", {}).get("driver") == DRIVER_NAME
        ]

    async def pv(self, name: str) -> Obj | None:
        try:
            return await self.api.get(PERSISTENT_VOLUMES, name)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def bound(self, *claims: str, timeout: float = 20) -> dict[str, Obj]:
        """Waits until every claim is Bound; returns their PVs by claim name."""

        async def check() -> list[str]:
            problems = []
            for c in claims:
                pvc = await self.pvc(c)
                phase = (pvc or {}).get("status", {}).get("phase")
                if phase != "Bound":
                    problems.append(f"{c}: {phase}")
            return problems

        await eventually_async(
            f"claims {', '.join(claims)} bound",
            check,
            timeout,
            0.2,
            satisfied=no_problems,
            context=self.log_tail,
        )
        out = {}
        for c in claims:
            pvc = await self.pvc(c)
            assert pvc is not None
            pv = await self.pv(pvc["spec"]["volumeName"])
            assert pv is not None
            out[c] = pv
        return out

    async def events(self, name: str, component_prefix: str = "") -> list[tuple[str, str]]:
        """The (reason, message) of the events about `name`; with `component_prefix`, only those of
        the components whose source starts with it (the provisioner's is `<driver>_<host>`)."""
        items = (await self.api.list_page(EVENTS, self.ns))["items"]
        return [
            (e["reason"], e["message"])
            for e in items
            if e["involvedObject"].get("name") == name
            and str((e.get("source") or {}).get("component") or "").startswith(component_prefix)
        ]

    async def wait_event(self, name: str, reason: str, text: str = "", timeout: float = 20) -> str:
        async def check() -> list[str]:
            events = await self.events(name)
            for r, m in events:
                if r == reason and text in m:
                    return []
            return [f"no {reason} event containing {text!r} for {name} among {events}"]

        await eventually_async(
            f"a {reason} event for {name}", check, timeout, 0.2, satisfied=no_problems, context=self.log_tail
        )
        return next(m for r, m in await self.events(name) if r == reason and text in m)

    # -- the invariant -----------------------------------------------------------------------------

    def backing_files(self) -> set[str]:
        pool = self.root / "pool" / "volumes"
        return {p.name.removesuffix(".img") for p in pool.glob("*.img")} if pool.exists() else set()

    async def pv_handles(self) -> set[str]:
        return {p["spec"]["csi"]["volumeHandle"] for p in await self.pvs()}

    async def assert_files_equal_pvs(self, timeout: float = 30) -> None:
        async def check() -> list[str]:
            files, handles = self.backing_files(), await self.pv_handles()
            return (
                [] if files == handles else [f"backing files {sorted(files)} != PV handles {sorted(handles)}"]
            )

        await eventually_async(
            "the backing files to be the PVs' volumes",
            check,
            timeout,
            0.2,
            satisfied=no_problems,
            context=self.log_tail,
        )

    # -- clean-up ----------------------------------------------------------------------------------

    async def delete_claims(self) -> None:
        for pvc in (await self.api.list_page(PERSISTENT_VOLUME_CLAIMS, self.ns))["items"]:
            md = pvc["metadata"]
            with contextlib.suppress(ApiError):
                await self.api.delete(PERSISTENT_VOLUME_CLAIMS, md["name"], self.ns)
            # A failed test may leave a clone source protected, and the provisioner is stopped.
            if CLONE_FINALIZER in (md.get("finalizers") or []):
                rest = [f for f in md["finalizers"] if f != CLONE_FINALIZER]
                with contextlib.suppress(ApiError):
                    patch = {"metadata": {"finalizers": rest or None}}
                    await self.api.patch(PERSISTENT_VOLUME_CLAIMS, md["name"], patch, self.ns)

    async def cleanup(self) -> None:
        await self.stop_provisioner()
        if self._pv_task is not None:
            self._pv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pv_task
        if self._pv_recorder is not None:
            await self._pv_recorder.close()
        if self._pv_client is not None:
            await self._pv_client.close()
        await self.delete_claims()
        for pv in await self.pvs():
            name = pv["metadata"]["name"]
            with contextlib.suppress(ApiError):
                await self.api.patch(PERSISTENT_VOLUMES, name, {"metadata": {"finalizers": None}})
            with contextlib.suppress(ApiError):
                await self.api.delete(PERSISTENT_VOLUMES, name)
        for name in self.classes:
            with contextlib.suppress(ApiError):
                await self.api.delete(STORAGE_CLASSES, name)
        if self.driver is not None:
            self.driver.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.asynccontextmanager
async def harness(
    cp: ControlPlane,
    api: ApiClient,
    namespace: str,
    *,
    driver_args: Sequence[str] = (),
    provisioner_args: Sequence[str] = (),
    provisioner: bool = True,
    rbac: Path | None = None,
    kubeconfig: Path | None = None,
) -> AsyncIterator[Harness]:
    """Driver, pv-controller and provisioner running; everything torn down afterwards. The
    provisioner runs under `rbac` as `kubeconfig`'s identity, by default kubeloop's own."""
    h = Harness(cp, api, namespace)
    h.rbac, h.kubeconfig = rbac or h.rbac, kubeconfig
    try:
        h.start_driver(*driver_args)
        await h.start_pv_controller()
        if provisioner:
            await h.start_provisioner(*provisioner_args)
        yield h
    finally:
        await h.cleanup()


async def create_topology_node(api: ApiClient, name: str) -> None:
    """A Ready Node labelled with the driver's topology key, and its CSINode listing the driver.
    No kubelet runs: nothing ever starts a pod there. kcm's node controllers write the Node too,
    so the status update is retried on conflict."""
    from controller_runtime.resources import CSI_NODES, NODES
    from csi_driver import TOPOLOGY_KEY

    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", TOPOLOGY_KEY: name}
    await api.create(NODES, {"metadata": {"name": name, "labels": labels}})
    resources = {"cpu": "4", "memory": "8Gi", "pods": "110"}

    async def ready() -> None:
        node = await api.get(NODES, name)
        node["status"] = {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test"}],
        }
        await api.update_status(NODES, node)

    await until_written(f"node {name} Ready", ready, lambda err: err.conflict)
    await api.create(
        CSI_NODES,
        {
            "metadata": {"name": name},
            "spec": {"drivers": [{"name": DRIVER_NAME, "nodeID": name, "topologyKeys": [TOPOLOGY_KEY]}]},
        },
    )
