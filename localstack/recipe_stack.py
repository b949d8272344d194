"""`make up DRIVER=recipe.yaml` (issue 48): the stack with kubeloop's CSI driver replaced by any
driver a driver-bench recipe describes (driver_bench/recipe.py, docs/driver-bench.md), with shared
pools, or with `POOLS=node-local` for a driver whose every node holds its own volumes (below).

Everything but the driver stays as `make up` runs it: kcm, the scheduler, the pv-controller, the
attach-detach and expand controllers, kubeloop's external-provisioner, -attacher and -resizer on
the controller plugin's socket, one node agent per node. What changes:

- `csi-driver-controller` runs the recipe's controller command, and `csi-driver-node-<node>` its
  node command (the controller's when it has none: one process serving every service), with the
  placeholders filled per instance: each its own socket, state directory and `{node_id}`, all one
  `{shared_dir}` (`$KUBELOOP_HOME/driver/`, the backend every node reaches, as the shared pool is);
- a kubeloop node-driver-registrar beside each node plugin registers it with its node agent (a
  foreign driver does not serve kubelet's plugin registration itself);
- a plugin is ready when its socket answers GetPluginInfo and Probe within the recipe's
  ready.timeout_seconds, as in the bench (driver_bench.runner.wait_ready);
- the CSIDriver, the StorageClass and (with a snapshot_class) the VolumeSnapshotClass are made from
  the recipe's fields under the driver's name, in place of kubeloop's deploy/ manifests; RBAC stays;
- with `--driver-fault` each plugin instance is driver_bench.stack_plugin instead: the bench's fault
  proxy on the socket the stack dials, the recipe's command behind it on `driver.sock`, every call
  written to the instance's `calls.jsonl` (the stack campaign, driver_bench/stack_campaign.py).

With node-local pools the node-local registry is the base (csi-driver-host-path's distributed
deployment, TopoLVM): no controller instance; on each node one instance of the recipe's command
serving every service, its `{shared_dir}` the node's own (`$KUBELOOP_HOME/nodes/<node>/driver/`),
with that node's external-provisioner and -resizer in node deployment and csi-snapshotter taking
that node's snapshots. The recipe must then have one command (no `node`) and a CSIDriver without
attach (no attacher runs per node); the node agent learns each node's topology from NodeGetInfo
and labels the Node with it, as kubelet does, and the provisioner creates each volume on the node
the scheduler chose (`--strict-topology`). kubeloop's node finalizer is left out: it cleans up its
own driver's volumes.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from controller_runtime.csi_client import CSIConnection
from driver_bench.recipe import Filled, Recipe, RecipeError, Service
from driver_bench.runner import wait_ready

from .components import (
    Component,
    ComponentContext,
    controller_socket,
    node_dir,
    node_home,
    node_socket,
    python_module,
    registry,
)
from .pools import NODE_LOCAL, SHARED, PoolMode
from .proc import ManagedProcess

# The node id the controller instance's placeholders get: it serves no node, but a driver whose one
# command serves every service (the recipe has no `node`) may require one.
CONTROLLER_NODE_ID = "controller"
# The registrars' --http-endpoint ports, one per node: a block of their own (docs/local-stack.md).
REGISTRAR_PORT = 18160
# How long the provisioner's manifests wait for the controller plugin's name when the recipe has none.
PLUGIN_INFO_TIMEOUT = 30.0


def shared_dir(home: Path, node: str | None = None) -> Path:
    """`{shared_dir}`: one directory for every instance of the driver, like the shared pool; with
    node-local pools (`node` given) the node's own."""
    return node_home(home, node) / "driver" if node else home / "driver"


def _filled(
    recipe: Recipe, home: Path, node: str | None, state_dir: Path, socket: Path, backend: Path | None = None
) -> Filled:
    """The placeholders' values for one instance (`node` None: the controller's); `backend` is its
    `{shared_dir}`, the shared one by default."""
    return Filled(
        socket=socket,
        node_id=node or CONTROLLER_NODE_ID,
        state_dir=state_dir / "state",
        # A node plugin's staging and target paths are under its node agent's root; the controller
        # instance gets a directory of its own, which nothing mounts under.
        kubelet_dir=node_home(home, node) / "kubelet" if node else state_dir / "kubelet",
        recipe_dir=recipe.path.parent,
        shared_dir=backend or shared_dir(home),
    )


def inventory_filled(recipe: Recipe, home: Path, pools: PoolMode, nodes: list[str]) -> list[Filled]:
    """The placeholders the stack campaign runs the recipe's inventory command with, as the bench
    runs it with its controller's: the controller instance's, or with node-local pools each node's
    instance's (the backend is the union of the nodes')."""
    if pools == NODE_LOCAL:
        return [
            _filled(
                recipe,
                home,
                n,
                home / "components" / f"csi-driver-node-{n}",
                home / "unused.sock",
                shared_dir(home, n),
            )
            for n in nodes
        ]
    state_dir = home / "components" / "csi-driver-controller"
    return [_filled(recipe, home, None, state_dir, state_dir / "csi.sock")]


def _instance_filled(recipe: Recipe, c: ComponentContext, socket: Path, node_local: bool) -> Filled:
    backend = shared_dir(c.home, c.node) if node_local else None
    return _filled(recipe, c.home, c.node, c.state_dir, socket, backend)


def calls_file(state_dir: Path) -> Path:
    """Where a plugin instance's fault proxy writes the calls it saw (its state directory)."""
    return state_dir / "calls.jsonl"


def _proxied_argv(
    recipe: Recipe, c: ComponentContext, socket: Path, per_node: bool, fault: str, node_local: bool
) -> list[str]:
    """The instance as driver_bench.stack_plugin: the proxy on `socket`, the driver behind it on a
    socket of its own, with the placeholders the instance would have had."""
    filled = _instance_filled(recipe, c, c.state_dir / "driver.sock", node_local)
    return python_module(
        "driver_bench.stack_plugin",
        f"--recipe={recipe.path}",
        f"--role={'node' if per_node else 'controller'}",
        f"--listen={socket}",
        f"--socket={filled.socket}",
        f"--node-id={filled.node_id}",
        f"--state-dir={filled.state_dir}",
        f"--kubelet-dir={filled.kubelet_dir}",
        f"--shared-dir={filled.shared_dir}",
        f"--work={c.state_dir}",
        f"--calls={calls_file(c.state_dir)}",
        f"--fault={fault}",
    )


def _plugin(
    recipe: Recipe, service: Service, name: str, per_node: bool, fault: str | None, node_local: bool = False
) -> Component:
    """A plugin instance running the recipe's `service`; behind the fault proxy when `fault` is not
    None ("none": the proxy only records); `node_local`: on its node's own backend."""
    socket = node_socket if per_node else controller_socket

    async def ready(c: ComponentContext, proc: ManagedProcess) -> None:
        where = f"recipe {recipe.path}: the {service.role} command as {c.name} ({socket(c)})"
        await wait_ready(recipe, socket(c), where, lambda: proc.returncode, proc.log_path)

    def filled(c: ComponentContext) -> Filled:
        return _instance_filled(recipe, c, socket(c), node_local)

    def dirs(c: ComponentContext) -> list[Path]:
        f = filled(c)
        return [f.state_dir, f.kubelet_dir, f.shared_dir or shared_dir(c.home)]

    def argv(c: ComponentContext) -> list[str]:
        if fault is not None:
            return _proxied_argv(recipe, c, socket(c), per_node, fault, node_local)
        return recipe.argv(service, filled(c))

    def env(c: ComponentContext) -> dict[str, str]:
        # Behind the proxy the recipe's env is the driver's (stack_plugin starts it), not the proxy's.
        return {} if fault is not None else recipe.environment(filled(c))

    return Component(
        name=name,
        argv=argv,
        env=env,
        health_path=None,
        per_node=per_node,
        host_dirs=dirs,
        ready=ready,
    )


def _registrar() -> Component:
    """kubelet learns of a node plugin through plugins_registry; the node agent does the same."""
    return Component(
        name="node-driver-registrar",
        argv=lambda c: python_module(
            "node_driver_registrar.main",
            f"--csi-address={node_socket(c)}",
            f"--kubelet-registration-path={node_socket(c)}",
            f"--plugin-registration-path={node_dir(c) / 'kubelet' / 'plugins_registry'}",
            f"--http-endpoint={c.http_endpoint}",
        ),
        http_port=REGISTRAR_PORT,
        # Live once its registration socket serves the driver's name (it needs no node agent).
        health_path="/healthz",
        per_node=True,
        host_dirs=lambda c: [node_dir(c) / "kubelet" / "plugins_registry"],
    )


async def driver_name(recipe: Recipe, c: ComponentContext, pools: PoolMode = SHARED) -> str:
    """The recipe's driver_name (its plugins were checked to report it), else what the controller
    plugin's GetPluginInfo says (node-local: the node's plugin)."""
    if recipe.driver_name:
        return recipe.driver_name
    socket = node_socket(c) if pools == NODE_LOCAL else controller_socket(c)
    csi = CSIConnection.open(f"unix://{socket}", timeout=PLUGIN_INFO_TIMEOUT)
    try:
        return await csi.wait_driver_name()
    finally:
        await csi.close()


def class_objects(recipe: Recipe, driver: str) -> list[dict[str, Any]]:
    """The CSIDriver and StorageClass of the recipe's fields (docs/driver-bench.md)."""
    sc = recipe.storage_class
    parameters = recipe.parameters
    if recipe.fs_type:  # how external-provisioner learns the fs_type of the volume capability
        parameters["csi.storage.k8s.io/fstype"] = recipe.fs_type
    storage_class: dict[str, Any] = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": recipe.storage_class_name},
        "provisioner": driver,
        "parameters": parameters,
        "reclaimPolicy": str(sc.get("reclaimPolicy", "Delete")),
        "volumeBindingMode": str(sc.get("volumeBindingMode", "Immediate")),
        "allowVolumeExpansion": bool(sc.get("allowVolumeExpansion", False)),
    }
    if recipe.mount_options:
        storage_class["mountOptions"] = recipe.mount_options
    csidriver = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "CSIDriver",
        "metadata": {"name": driver},
        "spec": dict(recipe.csi_driver),
    }
    return [csidriver, storage_class]


def snapshot_class(recipe: Recipe, driver: str) -> dict[str, Any]:
    return {
        "apiVersion": "snapshot.storage.k8s.io/v1",
        "kind": "VolumeSnapshotClass",
        "metadata": {"name": recipe.storage_class_name},
        "driver": driver,
        "deletionPolicy": "Delete",
        "parameters": dict(recipe.snapshot_parameters),
    }


def _rbac_only(comp: Component) -> tuple[str, ...]:
    """A component's manifests without kubeloop's own driver objects, which the recipe's replace."""
    return tuple(m for m in comp.manifests if m.startswith("deploy/rbac/"))


def node_local_problem(recipe: Recipe) -> str | None:
    """Why the recipe cannot run with node-local pools, or None."""
    if recipe.node is not None:
        return (
            f"recipe {recipe.path}: with --pools {NODE_LOCAL} each node runs one instance serving every "
            "service, the recipe's controller.command: a recipe with a node.command runs with shared pools"
        )
    if recipe.attach_required:
        return (
            f"recipe {recipe.path}: csi_driver.attachRequired must be false with --pools {NODE_LOCAL} "
            "(a node-local volume is never attached: no external-attacher runs per node)"
        )
    return None


def recipe_registry(
    recipe: Recipe, fault: str | None = None, pools: PoolMode = SHARED
) -> tuple[Component, ...]:
    """The pool mode's registry, in its start order, on the recipe's driver; with `fault` (KIND:STEP
    or "none") every plugin behind the bench's fault proxy armed with it."""
    node_local = pools == NODE_LOCAL

    async def classes(c: ComponentContext) -> list[dict[str, Any]]:
        return class_objects(recipe, await driver_name(recipe, c, pools))

    async def snapshots(c: ComponentContext) -> list[dict[str, Any]]:
        return [snapshot_class(recipe, await driver_name(recipe, c, pools))]

    out: list[Component] = []
    for comp in registry(pools):
        if comp.name == "csi-driver-controller":
            out.append(_plugin(recipe, recipe.controller, comp.name, False, fault))
        elif comp.name == "csi-driver-node":
            service = recipe.node or recipe.controller
            out += [_plugin(recipe, service, comp.name, True, fault, node_local), _registrar()]
        elif comp.name == "node-finalizer":
            continue  # it deletes the claims of a deleted node's kubeloop volumes: kubeloop's driver's own
        elif comp.name == "external-provisioner":
            # Node-local: each node's provisioner makes the classes; the first to start wins, the
            # others apply the same objects again.
            out.append(dataclasses.replace(comp, manifests=_rbac_only(comp), objects=classes))
        elif comp.name in ("snapshot-controller", "csi-snapshotter"):
            # csi-snapshotter exits at once on a driver that cannot snapshot: only with a snapshot_class.
            if recipe.snapshots:
                objects = snapshots if comp.name == "csi-snapshotter" else None
                out.append(dataclasses.replace(comp, manifests=_rbac_only(comp), objects=objects))
        else:
            out.append(comp)
    return tuple(out)


def check_commands(recipe: Recipe, home: Path) -> None:
    """Refuses, before anything starts, a recipe whose commands cannot be found (the bench's runner
    says so when it starts one; the stack would start its control plane first)."""
    for service in recipe.services:
        # Only the program matters here: {python} or a {recipe_dir} script, never a state path.
        program = recipe.argv(service, _filled(recipe, home, None, home, home))[0]
        if shutil.which(program) is None:
            raise RecipeError(
                f"recipe {recipe.path}: {service.role}.command: cannot run {program!r}: not found"
            )
