"""The kubeloop processes `make up` starts after the control plane, as a declarative registry.

Adding a component is one `Component(...)` entry in `REGISTRY`, for example:

    Component(
        name="pv-controller",
        argv=lambda c: python_module(
            "services.pv_controller.main",
            f"--kubeconfig={c.kubeconfig}",
            f"--http-endpoint={c.http_endpoint}",
        ),
        identity=service_account_identity("kubeloop-pv-controller"),
        http_port=18081,
        manifests=("deploy/rbac/pv-controller.yaml",),
    )

The launcher then writes a client certificate and kubeconfig for the identity (so the component runs
under its ServiceAccount's RBAC, never as admin), applies the manifests as admin (its RBAC), checks
the port is free, starts the process (once per node when `per_node`), and waits for its health URL.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from controller_runtime.certs import Identity
from controller_runtime.logs import get_logger
from controller_runtime.toolchain import REPO_ROOT, Toolchain
from csi_driver import DRIVER_NAME

from .certs import service_account_identity
from .controlplane import ControlPlane, Ports, StatusCallback, UnexpectedExitCallback, log_unexpected_exit
from .pools import (
    CSIDRIVER_KIND,
    NODE_LOCAL,
    SHARED,
    PoolCapacity,
    PoolMode,
    csidriver_conflict,
    manifests_for_mode,
    node_pool_dir,
    shared_pool_dir,
)
from .proc import ManagedProcess, RestartCallback, RestartPolicy, wait_healthy
from .snapshotter import snapshot_crds, snapshotter_binary

log = get_logger("stack")


@dataclass(frozen=True)
class ComponentContext:
    """What a component's argv factory is given: where the stack is and what belongs to this instance."""

    name: str  # the instance name: the component's, or `<component>-<node>` for per-node ones
    home: Path
    server: str  # the apiserver URL
    ca_file: Path  # the stack CA (verifies the apiserver)
    kubeconfig: Path | None  # the component identity's kubeconfig, None if it has no identity
    node: str | None  # the node name for a per-node component
    state_dir: Path  # a directory of its own under home, created before start
    http_endpoint: str  # `127.0.0.1:<port>` for its --http-endpoint, or "" without http_port
    ports: Ports
    repo_root: Path
    # The size its pool offers (the driver's --capacity), "" for the pool filesystem's free space.
    pool_capacity: str = ""


ArgvFactory = Callable[[ComponentContext], list[str]]
EnvFactory = Callable[[ComponentContext], dict[str, str]]
# Waits until a started instance is ready, raising why not: for a process with no health endpoint
# to poll (a CSI driver from a recipe answers on its socket only).
ReadyWait = Callable[[ComponentContext, ManagedProcess], Awaitable[None]]
# Objects made when the component's manifests are applied (a recipe's CSIDriver and classes, which
# need the driver's name, known once its plugin answers).
ObjectsFactory = Callable[[ComponentContext], Awaitable[list[dict[str, Any]]]]


@dataclass(frozen=True)
class Component:
    name: str
    argv: ArgvFactory
    # Who it authenticates as (a ServiceAccount identity, see certs.service_account_identity);
    # None for a process that never talks to the API server (e.g. the CSI driver itself).
    identity: Identity | None = None
    # Base port of its --http-endpoint; a per-node component's instance i (0-based) gets port + i.
    http_port: int | None = None
    # Path on the http endpoint that answers 200 once the component is ready; None: started = ready.
    health_path: str | None = "/readyz"
    per_node: bool = False
    # Manifests (relative to the repository root) applied as admin before it starts: its RBAC.
    manifests: tuple[str, ...] = ()
    # Environment variables it gets on top of the launcher's (a Deployment's `env:`).
    env: EnvFactory | None = None
    # Directories the machine provides before it starts (a DaemonSet's hostPath volumes).
    host_dirs: Callable[[ComponentContext], list[Path]] | None = None
    # CustomResourceDefinitions it needs, applied and waited for (Established) before its manifests.
    crds: Callable[[], list[Path]] | None = None
    # Files written into its state directory before it starts (a ConfigMap mounted in a Deployment).
    files: Callable[[ComponentContext], dict[str, str]] | None = None
    # Readiness other than health_path on its http port, awaited after each instance starts.
    ready: ReadyWait | None = None
    # Objects applied with its manifests, made at that time.
    objects: ObjectsFactory | None = None


def node_name_env(c: ComponentContext) -> dict[str, str]:
    """What a DaemonSet's pod gets from the downward API (spec.nodeName), for --node-deployment."""
    return {"NODE_NAME": str(c.node)}


# Components in start order: a component may rely on those listed before it being healthy.
# The argv factories each mode's entries share are below the registries.
PV_CONTROLLER = Component(
    name="pv-controller",
    argv=lambda c: python_module(
        "services.pv_controller.main",
        f"--kubeconfig={c.kubeconfig}",
        f"--http-endpoint={c.http_endpoint}",
    ),
    identity=service_account_identity("kubeloop-pv-controller"),
    http_port=18081,
    manifests=("deploy/rbac/pv-controller.yaml",),
)
# kubelet's part for each node: registers the Node, mounts the volumes of its pods. The node stops
# with its agent, and a stop of the stack stops the agent before its node plugin: the agent unmounts
# its volumes on the way out, so nothing stays mounted or attached after the stack (its next start
# mounts them again for the pods still there).
NODE_AGENT = Component(
    name="node-agent",
    argv=lambda c: python_module(
        "services.node_agent.main",
        f"--node-name={c.node}",
        f"--root-dir={node_dir(c) / 'kubelet'}",
        f"--kubeconfig={c.kubeconfig}",
        f"--http-endpoint={c.http_endpoint}",
        "--unmount-volumes-on-exit",
        # kubelet asks each volume for its usage every minute; a laptop's stack every 10 s, so a
        # file written shows in kubelet_volume_stats_used_bytes while one still looks.
        "--volume-stats-agg-period=10s",
    ),
    identity=service_account_identity("kubeloop-node-agent"),
    http_port=18120,
    per_node=True,
    manifests=("deploy/rbac/node-agent.yaml",),
)
ATTACH_DETACH_CONTROLLER = Component(
    name="attach-detach-controller",
    argv=lambda c: python_module(
        "services.attach_detach.main",
        f"--kubeconfig={c.kubeconfig}",
        f"--http-endpoint={c.http_endpoint}",
    ),
    identity=service_account_identity("kubeloop-attach-detach"),
    http_port=18102,
    manifests=("deploy/rbac/attach-detach-controller.yaml",),
)
# Expansion: kcm's expand controller, and the resizer sidecar beside the driver's controller.
VOLUME_EXPAND_CONTROLLER = Component(
    name="volume-expand-controller",
    argv=lambda c: python_module(
        "services.volume_expand.main",
        f"--kubeconfig={c.kubeconfig}",
        f"--http-endpoint={c.http_endpoint}",
    ),
    identity=service_account_identity("kubeloop-volume-expand"),
    http_port=18103,
    manifests=("deploy/rbac/volume-expand-controller.yaml",),
)
# external-snapshotter's two (upstream's Go binaries, localstack.snapshotter): the cluster's
# snapshot-controller, and the csi-snapshotter sidecar beside the driver's controller service.
SNAPSHOT_CONTROLLER_IDENTITY = service_account_identity("kubeloop-snapshot-controller")
CSI_SNAPSHOTTER_IDENTITY = service_account_identity("kubeloop-csi-snapshotter")


def snapshot_controller(*extra: str) -> Component:
    return Component(
        name="snapshot-controller",
        argv=lambda c: [
            str(snapshotter_binary("snapshot-controller")),
            f"--kubeconfig={c.kubeconfig}",
            f"--http-endpoint={c.http_endpoint}",
            *extra,
            "--v=2",
        ],
        identity=SNAPSHOT_CONTROLLER_IDENTITY,
        http_port=18106,
        health_path="/metrics",
        manifests=("deploy/rbac/snapshot-controller.yaml",),
        crds=snapshot_crds,
    )


def csi_snapshotter(
    socket: Callable[[ComponentContext], Path], http_port: int, node_deployment: bool = False
) -> Component:
    """The sidecar on a driver's socket; with `node_deployment` one per node, each taking the
    contents of its own node's volumes."""
    return Component(
        name="csi-snapshotter",
        argv=lambda c: [
            str(snapshotter_binary("csi-snapshotter")),
            f"--csi-address={socket(c)}",
            f"--kubeconfig={c.kubeconfig}",
            f"--http-endpoint={c.http_endpoint}",
            *(["--node-deployment"] if node_deployment else []),
            "--v=2",
        ],
        identity=CSI_SNAPSHOTTER_IDENTITY,
        http_port=http_port,
        health_path="/metrics",
        per_node=node_deployment,
        manifests=("deploy/rbac/csi-snapshotter.yaml", "deploy/volumesnapshotclass.yaml"),
        env=node_name_env if node_deployment else None,
    )


PROVISIONER_IDENTITY = service_account_identity("kubeloop-external-provisioner")
PROVISIONER_MANIFESTS = (
    "deploy/rbac/external-provisioner.yaml",
    "deploy/csidriver.yaml",
    "deploy/storageclasses.yaml",
)
RESIZER_IDENTITY = service_account_identity("kubeloop-external-resizer")
RESIZER_MANIFESTS = ("deploy/rbac/external-resizer.yaml",)
# What the sidecars running on every node read besides (their Node; the capacity owner's chain).
NODE_DEPLOYMENT_RBAC = "deploy/rbac/node-deployment.yaml"

REGISTRY: tuple[Component, ...] = (
    PV_CONTROLLER,
    # The driver's controller service (one per cluster) and its provisioner sidecar. The pool is
    # <home>/pool, shared with the node plugins; the sidecar finds the driver's socket by the
    # controller instance's state directory.
    Component(
        name="csi-driver-controller",
        argv=lambda c: driver_argv(
            c, "controller", f"unix://{c.state_dir / 'csi.sock'}", shared_pool_dir(c.home)
        ),
        http_port=18090,
    ),
    Component(
        name="external-provisioner",
        argv=lambda c: provisioner_argv(c, controller_socket(c)),
        identity=PROVISIONER_IDENTITY,
        http_port=18091,
        manifests=PROVISIONER_MANIFESTS,
    ),
    # One node plugin per node: its own socket and kubelet root (<home>/nodes/<node>/), the shared
    # pool, and the registration socket in <root>/plugins_registry the node agent discovers it by.
    Component(
        name="csi-driver-node",
        argv=lambda c: driver_argv(c, "node", f"unix://{node_socket(c)}", shared_pool_dir(c.home)),
        http_port=18110,
        per_node=True,
    ),
    NODE_AGENT,
    Component(
        name="external-attacher",
        argv=lambda c: python_module(
            "external_attacher.main",
            f"--kubeconfig={c.kubeconfig}",
            f"--csi-address=unix://{controller_socket(c)}",
            f"--http-endpoint={c.http_endpoint}",
        ),
        identity=service_account_identity("kubeloop-external-attacher"),
        http_port=18101,
        manifests=("deploy/rbac/external-attacher.yaml",),
    ),
    ATTACH_DETACH_CONTROLLER,
    VOLUME_EXPAND_CONTROLLER,
    Component(
        name="external-resizer",
        argv=lambda c: resizer_argv(c, controller_socket(c)),
        identity=RESIZER_IDENTITY,
        http_port=18104,
        manifests=RESIZER_MANIFESTS,
    ),
    snapshot_controller(),
    csi_snapshotter(lambda c: controller_socket(c), 18107),
)

# --pools node-local (issue 31): every node its own pool, served by its own plugin in `all` mode,
# with its own provisioner and resizer in node deployment (hostpath's distributed deployment,
# TopoLVM); no controller plugin, no external-attacher (the CSIDriver says attachRequired: false).
NODE_LOCAL_REGISTRY: tuple[Component, ...] = (
    PV_CONTROLLER,
    Component(
        name="csi-driver-node",
        argv=lambda c: [
            *driver_argv(c, "all", f"unix://{node_socket(c)}", node_pool_dir(c.home, str(c.node))),
            "--node-local",
        ],
        http_port=18110,
        per_node=True,
        # A node-local plugin refuses a pool that is not there: it is the node's disk, not its own.
        host_dirs=lambda c: [node_pool_dir(c.home, str(c.node))],
    ),
    Component(
        name="external-provisioner",
        argv=lambda c: [
            *provisioner_argv(c, node_socket(c)),
            "--node-deployment",
            "--strict-topology",
            "--immediate-topology=false",
            # A small pool fills in a few claims: the scheduler should see it within seconds, not
            # after upstream's default minute (GetCapacity is one cheap call per class).
            "--capacity-poll-interval=5s",
            # Two nodes, not hundreds: an Immediate claim waits seconds for a node to take it, not
            # upstream's up to 20 s (the jittered election stays as upstream's).
            "--node-deployment-base-delay=2s",
            "--node-deployment-max-delay=10s",
        ],
        identity=PROVISIONER_IDENTITY,
        http_port=18130,
        per_node=True,
        manifests=(*PROVISIONER_MANIFESTS, NODE_DEPLOYMENT_RBAC),
        env=node_name_env,
    ),
    NODE_AGENT,
    ATTACH_DETACH_CONTROLLER,
    VOLUME_EXPAND_CONTROLLER,
    Component(
        name="external-resizer",
        argv=lambda c: [*resizer_argv(c, node_socket(c)), "--node-deployment"],
        identity=RESIZER_IDENTITY,
        http_port=18140,
        per_node=True,
        manifests=(*RESIZER_MANIFESTS, NODE_DEPLOYMENT_RBAC),
        env=node_name_env,
    ),
    # Upstream's distributed snapshotting: each node's csi-snapshotter takes the contents of its
    # own volumes (the controller labels them with the node).
    snapshot_controller("--enable-distributed-snapshotting"),
    csi_snapshotter(lambda c: node_socket(c), 18150, node_deployment=True),
    # A node-local volume dies with its node's pool: when a Node is deleted, the claims and PVs
    # pinned to it are cleaned up (TopoLVM's node finalizer; docs/node-finalizer.md).
    Component(
        name="node-finalizer",
        argv=lambda c: python_module(
            "node_finalizer.main",
            f"--kubeconfig={c.kubeconfig}",
            f"--http-endpoint={c.http_endpoint}",
        ),
        identity=service_account_identity("kubeloop-node-finalizer"),
        http_port=18105,
        manifests=("deploy/rbac/node-finalizer.yaml",),
    ),
)


PROMETHEUS_PORT = 19090
ALERT_RULES = "deploy/prometheus/kubeloop-alerts.yaml"


def prometheus(targets: dict[str, int], port: int = PROMETHEUS_PORT) -> Component:
    """Prometheus (`make up PROMETHEUS=1`) scraping every kubeloop process of the stack (`targets`:
    instance name -> its --http-endpoint port on 127.0.0.1) every 10 s, with kubeloop's alerting
    rules loaded; its UI and API on 127.0.0.1:`port`."""

    def config(c: ComponentContext) -> dict[str, str]:
        doc = {
            "global": {"scrape_interval": "10s", "evaluation_interval": "10s"},
            "rule_files": [str(c.repo_root / ALERT_RULES)],
            "scrape_configs": [
                {
                    "job_name": name,
                    "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {"component": name}}],
                }
                for name, port in sorted(targets.items())
            ],
        }
        return {"prometheus.yml": yaml.safe_dump(doc, sort_keys=False)}

    return Component(
        name="prometheus",
        argv=lambda c: [
            str(Toolchain.default().binary("prometheus")),
            f"--config.file={c.state_dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={c.state_dir / 'data'}",
            f"--web.listen-address={c.http_endpoint}",
            "--storage.tsdb.retention.time=2d",
        ],
        http_port=port,
        health_path="/-/ready",
        files=config,
    )


def registry(mode: PoolMode) -> tuple[Component, ...]:
    return NODE_LOCAL_REGISTRY if mode == NODE_LOCAL else REGISTRY


def driver_argv(c: ComponentContext, mode: str, endpoint: str, pool: Path) -> list[str]:
    on_node = mode != "controller"
    args = [f"--mode={mode}"]
    args += [f"--node-id={c.node}"] if on_node else []
    args += [f"--endpoint={endpoint}", f"--pool-dir={pool}", f"--state-dir={c.state_dir / 'state'}"]
    args += [f"--kubelet-root-dir={node_dir(c) / 'kubelet'}"] if on_node else []
    if c.pool_capacity and mode != "node":  # the size is the controller side's to report
        args.append(f"--capacity={c.pool_capacity}")
    return python_module("csi_driver.main", *args, f"--http-endpoint={c.http_endpoint}")


def provisioner_argv(c: ComponentContext, socket: Path) -> list[str]:
    return python_module(
        "external_provisioner.main",
        f"--kubeconfig={c.kubeconfig}",
        f"--csi-address=unix://{socket}",
        f"--state-dir={c.state_dir}",
        "--extra-create-metadata",
        "--enable-capacity",
        # No pod owns the capacity objects here: the stack's processes are not pods.
        "--capacity-ownerref-level=-1",
        f"--http-endpoint={c.http_endpoint}",
    )


def resizer_argv(c: ComponentContext, socket: Path) -> list[str]:
    return python_module(
        "external_resizer.main",
        f"--kubeconfig={c.kubeconfig}",
        f"--csi-address=unix://{socket}",
        f"--http-endpoint={c.http_endpoint}",
    )


def python_module(module: str, *args: str) -> list[str]:
    """argv running a kubeloop module with the launcher's own interpreter (the venv's)."""
    return [sys.executable, "-m", module, *args]


@dataclass(frozen=True)
class Instance:
    component: Component
    name: str
    node: str | None
    http_port: int | None


def node_names(count: int) -> list[str]:
    """node-a, node-b, ... (node-<n> past the alphabet): short names that read well in kubectl."""
    return [f"node-{chr(ord('a') + i)}" if count <= 26 else f"node-{i + 1}" for i in range(count)]


def controller_socket(c: ComponentContext) -> Path:
    """The CSI controller service's socket, in the csi-driver-controller instance's state directory,
    where the controller-side sidecars (provisioner, attacher) connect."""
    return c.home / "components" / "csi-driver-controller" / "csi.sock"


def node_dir(c: ComponentContext) -> Path:
    """A simulated node's own directory: its kubelet root and its node plugin's socket."""
    return node_home(c.home, str(c.node))


def node_socket(c: ComponentContext) -> Path:
    """A node plugin's CSI socket, in its node's directory: the node agent's and, in node-local
    mode, the node's provisioner's and resizer's."""
    return node_dir(c) / "csi.sock"


def node_home(home: Path, node: str) -> Path:
    return home / "nodes" / node


def longest_socket_path(home: Path, nodes: Sequence[str], driver: str = DRIVER_NAME) -> Path:
    """The longest unix socket path the stack will create under `home`: a node's kubelet
    plugin-registration socket, `<driver>-reg.sock` (docs/contracts.md)."""
    longest = max(nodes, key=len)
    return node_home(home, longest) / "kubelet" / "plugins_registry" / f"{driver}-reg.sock"


def instances(components: Sequence[Component], nodes: Sequence[str]) -> list[Instance]:
    out: list[Instance] = []
    for comp in components:
        if comp.per_node:
            for i, node in enumerate(nodes):
                port = comp.http_port + i if comp.http_port is not None else None
                out.append(Instance(comp, f"{comp.name}-{node}", node, port))
        else:
            out.append(Instance(comp, comp.name, None, comp.http_port))
    return out


def instance_ports(components: Sequence[Component], nodes: Sequence[str]) -> dict[str, int]:
    """Port by purpose for the port check, like Ports.described()."""
    return {
        f"{inst.name} (--http-endpoint)": inst.http_port
        for inst in instances(components, nodes)
        if inst.http_port is not None
    }


class ComponentError(RuntimeError):
    pass


class Components:
    """Starts and stops the registry's processes against a running ControlPlane."""

    def __init__(
        self,
        control_plane: ControlPlane,
        components: Sequence[Component] = REGISTRY,
        nodes: Sequence[str] = ("node-a", "node-b"),
        *,
        startup_timeout: float = 60.0,
        stop_timeout: float = 15.0,
        on_status: StatusCallback | None = None,
        on_unexpected_exit: UnexpectedExitCallback | None = None,
        restart: RestartPolicy | None = None,
        on_restart: RestartCallback | None = None,
        pools: PoolMode = SHARED,
        pool_capacity: PoolCapacity | None = None,
    ) -> None:
        """With a `restart` policy every process is supervised: restarted with backoff after a
        crash (`on_restart` is told); without one a crash only calls `on_unexpected_exit`. `pools`
        says which CSIDriver the manifests make (`components` is that mode's registry) and
        `pool_capacity` what each pool offers."""
        self.cp = control_plane
        self.pools = pools
        self.pool_capacity = pool_capacity or PoolCapacity()
        self.components = tuple(components)
        self.nodes = tuple(nodes)
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._on_status = on_status
        self._on_unexpected_exit = on_unexpected_exit or log_unexpected_exit
        self.restart = restart
        self._on_restart = on_restart
        self.processes: dict[str, ManagedProcess] = {}
        self.startup_seconds: dict[str, float] = {}

    def context(self, inst: Instance) -> ComponentContext:
        comp = inst.component
        state_dir = self.cp.home / "components" / inst.name
        return ComponentContext(
            name=inst.name,
            home=self.cp.home,
            server=self.cp.server,
            ca_file=self.cp.ca_file,
            kubeconfig=self.cp.kubeconfig_for(comp.identity) if comp.identity is not None else None,
            node=inst.node,
            state_dir=state_dir,
            http_endpoint=f"127.0.0.1:{inst.http_port}" if inst.http_port is not None else "",
            ports=self.cp.ports,
            repo_root=REPO_ROOT,
            pool_capacity=self.pool_capacity.for_node(inst.node),
        )

    async def _kubectl(self, *args: str, stdin: str | None = None) -> tuple[int, str]:
        """kubectl as admin: its exit status and its output (stdout and stderr)."""
        kubectl = str(self.cp.toolchain.binary("kubectl"))
        proc = await asyncio.create_subprocess_exec(
            kubectl,
            f"--kubeconfig={self.cp.admin_kubeconfig}",
            *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await proc.communicate(stdin.encode() if stdin is not None else None)
        return proc.returncode or 0, out.decode(errors="replace")

    async def check_pool_mode(self) -> None:
        """Refuses a cluster whose CSIDriver was made for the other pool mode (etcd/ is kept across
        runs), before anything starts."""
        code, out = await self._kubectl("get", "csidriver", DRIVER_NAME, "-o", "json", "--ignore-not-found")
        if code != 0:
            raise ComponentError(f"reading the CSIDriver {DRIVER_NAME} failed:\n{out}")
        problem = csidriver_conflict(json.loads(out) if out.strip() else None, self.pools)
        if problem is not None:
            raise ComponentError(problem)

    def manifests(self, comp: Component) -> list[dict[str, Any]]:
        """The component's manifests as this pool mode needs them (node-local: the CSIDriver without
        attach)."""
        return manifests_for_mode(((REPO_ROOT / m).read_text() for m in comp.manifests), self.pools)

    async def apply_crds(self, comp: Component) -> None:
        if comp.crds is None:
            return
        files = [f"--filename={path}" for path in comp.crds()]
        code, out = await self._kubectl("apply", "--server-side", "--force-conflicts", *files)
        if code == 0:
            code, out = await self._kubectl("wait", "--for=condition=established", "--timeout=60s", *files)
        if code != 0:
            raise ComponentError(f"applying the CRDs of {comp.name} failed:\n{out}")
        log.info("applied CRDs", component=comp.name, crds=len(files))

    async def apply_manifests(self, comp: Component) -> None:
        await self.apply_crds(comp)
        docs = self.manifests(comp)
        if comp.objects is not None:
            docs += await comp.objects(self.context(instances([comp], self.nodes)[0]))
        if not docs:
            return
        code, out = await self._kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs, sort_keys=False))
        if code != 0:
            raise ComponentError(f"applying the manifests of {comp.name} failed:\n{out}")
        log.info("applied manifests", component=comp.name, manifests=",".join(comp.manifests))

    async def _start_instance(self, inst: Instance) -> None:
        ctx = self.context(inst)
        ctx.state_dir.mkdir(parents=True, exist_ok=True)
        for path in inst.component.host_dirs(ctx) if inst.component.host_dirs is not None else []:
            path.mkdir(parents=True, exist_ok=True)
        for name, text in (inst.component.files(ctx) if inst.component.files is not None else {}).items():
            (ctx.state_dir / name).write_text(text)
        log_path = self.cp.log_path(inst.name)
        if log_path.exists():
            log_path.replace(log_path.with_name(f"{inst.name}.previous.log"))
        env = inst.component.env
        proc = ManagedProcess(
            name=inst.name,
            argv=inst.component.argv(ctx),
            log_path=log_path,
            env={**os.environ, **env(ctx)} if env is not None else None,
            cwd=REPO_ROOT,
            on_unexpected_exit=self._on_unexpected_exit,
            restart=self.restart,
            on_restart=self._on_restart,
        )
        self.processes[inst.name] = proc
        await proc.start()
        seconds = 0.0
        if inst.component.ready is not None:
            began = time.monotonic()
            await inst.component.ready(ctx, proc)
            seconds = time.monotonic() - began
        elif inst.component.health_path is not None and inst.http_port is not None:
            url = f"http://127.0.0.1:{inst.http_port}{inst.component.health_path}"
            seconds = await wait_healthy(proc, url, timeout=self.startup_timeout)
        self.startup_seconds[inst.name] = seconds
        log.info("healthy", component=inst.name, took=f"{seconds:.2f}s", pid=proc.pid, log=str(log_path))
        if self._on_status is not None:
            self._on_status(inst.name, seconds)

    async def start(self) -> None:
        try:
            if any(d.get("kind") == CSIDRIVER_KIND for c in self.components for d in self.manifests(c)):
                await self.check_pool_mode()  # before anything runs against the wrong cluster
            for comp in self.components:
                await self.apply_manifests(comp)
                # A component's node instances come up together; the next component waits for them.
                await asyncio.gather(*(self._start_instance(i) for i in instances([comp], self.nodes)))
        except BaseException:
            await self.stop()
            raise

    def status(self) -> dict[str, dict[str, object]]:
        """Per instance: pid, running, supervised restarts, the last exit code and its HTTP endpoint
        (metrics, health, /debug/queues, which `kubectl kubeloop describe` reads), for status reports."""
        ports = {i.name: i.http_port for i in instances(self.components, self.nodes)}
        return {
            name: {
                "pid": proc.pid,
                "running": proc.running,
                "restarts": proc.restarts,
                "last_exit_code": proc.last_exit_code,
                "http_endpoint": f"127.0.0.1:{ports[name]}" if ports.get(name) else "",
            }
            for name, proc in self.processes.items()
        }

    async def stop(self) -> None:
        for proc in self.processes.values():
            proc.disarm()
        for name, proc in reversed(list(self.processes.items())):
            code = await proc.stop(self.stop_timeout)
            log.info("stopped", component=name, exit_code=code)
        self.processes.clear()
