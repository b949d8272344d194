"""The docker-compose stack: generates the checked-in docker-compose.yml from the same registry
`make up` runs (localstack/components.py REGISTRY), and holds the one-shot commands its services run.

    python -m localstack.compose generate   prints docker-compose.yml (tests/unit checks the
                                            checked-in file equals this output); with
                                            --pools node-local, docker-compose.node-local.yml
    python -m localstack.compose init       the `init` service: certificates, kubeconfigs, the admin
                                            kubeconfig for the host, kubectl for the healthchecks
    python -m localstack.compose setup      the `setup` service: applies every component's
                                            manifests (RBAC, CSIDriver, StorageClasses) as admin

Every service uses host networking (the local-only dockerd of tools/docker-env.sh has no bridge), so
the ports are fixed and chosen apart from the local stack's (docs/compose.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from controller_runtime.certs import Identity
from csi_driver import DRIVER_NAME

from . import certs
from .components import Component, ComponentContext, Instance, instances, node_names, registry
from .controlplane import KCM_CONTROLLERS, SERVICE_ACCOUNT_ISSUER, SERVICE_CLUSTER_IP_RANGE, Ports
from .pools import (
    NODE_LOCAL,
    POOL_MODES,
    SHARED,
    PoolCapacity,
    PoolMode,
    PoolOptionError,
    csidriver_conflict,
    manifests_for_mode,
    node_pool_dir,
    parse_pool_capacity,
    shared_pool_dir,
)

# Paths inside the containers.
HOME = Path("/var/lib/kubeloop")  # the stack home: pool/, components/<instance>/, nodes/<node>/
CONFIG = Path("/etc/kubeloop")  # the `config` volume: pki/, kubeconfigs/, kubeconfig (admin)
TOOLS = Path("/kubeloop-tools")  # the `tools` volume: kubectl, for the control plane's healthchecks
OUT = Path("/out")  # the host directory that receives the admin kubeconfig
MANIFESTS = Path("/usr/share/kubeloop")  # deploy/ is copied to /usr/share/kubeloop/deploy
NONROOT = 65532  # the image's non-root user (the image itself runs as root, as upstream's sidecars do)

# Host ports (host networking), apart from `make up`'s so both can run on one machine.
PORTS = Ports(
    etcd_client=22379, etcd_peer=22380, apiserver=7443, kube_controller_manager=20257, kube_scheduler=20259
)
COMPONENT_PORT_OFFSET = 10000  # a component's port is its registry port + this (18081 -> 28081)

NODES = tuple(node_names(2))
SERVER = f"https://127.0.0.1:{PORTS.apiserver}"
ETCD = f"http://127.0.0.1:{PORTS.etcd_client}"

# How long `docker-compose stop`/`down` lets a node agent unmount its volumes before SIGKILL
# (docker's default is 10s; `make up` gives every process 15s, its --stop-timeout).
NODE_AGENT_STOP_GRACE = "15s"

KUBELOOP_IMAGE = "kubeloop/kubeloop:0.1.0"
DEFAULT_BASE_IMAGE = "debian:bookworm-slim"

# Components whose process needs nothing root has: they run as the image's non-root user (each
# service names its user; the image's default is root). The CSI driver attaches loop devices and
# mounts (node plugin, privileged); its controller service shares
# the pool with the node plugins, whose files are root's 0600; the sidecars and the node agent talk to
# the driver's root-owned 0600 sockets. Those run as root, with capabilities dropped where they can.
NON_ROOT = frozenset(
    {
        "pv-controller",
        "attach-detach-controller",
        "volume-expand-controller",
        "node-finalizer",
        "snapshot-controller",
    }
)
# Capabilities a root component keeps (all others dropped); absent: docker's defaults.
ROOT_CAPS: dict[str, list[str]] = {
    "csi-driver-controller": ["CHOWN", "DAC_OVERRIDE", "FOWNER"],
    "external-provisioner": [],
    "external-attacher": [],
    "external-resizer": [],
    "csi-snapshotter": [],
}
# Components that are upstream's Go binaries, each in its own image (the binary is its entrypoint,
# and the image, built FROM scratch, has no shell for a healthcheck).
GO_IMAGES = frozenset({"snapshot-controller", "csi-snapshotter"})


def read_versions() -> dict[str, str]:
    from controller_runtime.toolchain import read_versions as read

    return read()


def images(versions: dict[str, str] | None = None) -> dict[str, str]:
    """The control-plane images under their conventional names, at the pinned versions."""
    v = versions or read_versions()
    k8s, snap = v["KUBERNETES_VERSION"], v["EXTERNAL_SNAPSHOTTER_VERSION"]
    return {
        "etcd": f"registry.k8s.io/etcd:{v['ETCD_VERSION'].removeprefix('v')}-0",
        "kube-apiserver": f"registry.k8s.io/kube-apiserver:{k8s}",
        "kube-controller-manager": f"registry.k8s.io/kube-controller-manager:{k8s}",
        "kube-scheduler": f"registry.k8s.io/kube-scheduler:{k8s}",
        "kubectl": f"registry.k8s.io/kubectl:{k8s}",
        # external-snapshotter's two (localstack.snapshotter), under upstream's image names.
        "snapshot-controller": f"registry.k8s.io/sig-storage/snapshot-controller:{snap}",
        "csi-snapshotter": f"registry.k8s.io/sig-storage/csi-snapshotter:{snap}",
    }


# The checked-in file of each mode.
COMPOSE_FILES: dict[PoolMode, str] = {
    SHARED: "docker-compose.yml",
    NODE_LOCAL: "docker-compose.node-local.yml",
}


def component_identities(mode: PoolMode) -> list[Identity]:
    return [c.identity for c in registry(mode) if c.identity is not None]


def kubeconfig_path(identity: Identity) -> Path:
    return CONFIG / "kubeconfigs" / f"{identity.file_stem}.kubeconfig"


def instance_port(inst: Instance) -> int | None:
    return None if inst.http_port is None else inst.http_port + COMPONENT_PORT_OFFSET


def context(inst: Instance, capacity: PoolCapacity | None = None) -> ComponentContext:
    comp = inst.component
    port = instance_port(inst)
    return ComponentContext(
        name=inst.name,
        home=HOME,
        server=SERVER,
        ca_file=CONFIG / "pki" / "ca.crt",
        kubeconfig=kubeconfig_path(comp.identity) if comp.identity is not None else None,
        node=inst.node,
        state_dir=HOME / "components" / inst.name,
        http_endpoint=f"127.0.0.1:{port}" if port is not None else "",
        ports=PORTS,
        repo_root=MANIFESTS,
        pool_capacity=(capacity or PoolCapacity()).for_node(inst.node),
    )


def container_argv(argv: Sequence[str]) -> list[str]:
    """The registry's argv with the launcher's interpreter replaced by the image's `python`."""
    out = list(argv)
    if len(out) >= 2 and out[1] == "-m":
        out[0] = "python"
    return out


def http_probe(port: int, path: str) -> str:
    """A healthcheck script for bash alone: an HTTP/1.0 GET on loopback that passes on a 2xx status.
    A probe runs every 2 s in a dozen containers, so it must not start a Python interpreter. (`$$` is
    compose's escape for `$`.)"""
    return (
        f"exec 3<>/dev/tcp/127.0.0.1/{port} && printf 'GET {path} HTTP/1.0\\r\\n\\r\\n' >&3 "
        "&& read -r _ code _ <&3 && [[ $$code == 2?? ]]"
    )


# --- the compose file -------------------------------------------------------------------------------

HEALTH = {"interval": "2s", "timeout": "5s", "retries": 5, "start_period": "90s"}


def _kubectl_health(*args: str) -> dict[str, Any]:
    return {"test": ["CMD", str(TOOLS / "kubectl"), *args], **HEALTH}


def _needs_controller_socket(comp: Component) -> bool:
    probe = context(Instance(comp, comp.name, NODES[0] if comp.per_node else None, comp.http_port))
    return any("components/csi-driver-controller/csi.sock" in a for a in comp.argv(probe))


def _control_plane_services(img: dict[str, str], mode: PoolMode) -> dict[str, Any]:
    pki = CONFIG / "pki"
    kc = CONFIG / "kubeconfigs"
    cfg_ro = f"config:{CONFIG}:ro"
    tools_ro = f"tools:{TOOLS}:ro"
    peer = f"http://127.0.0.1:{PORTS.etcd_peer}"
    init_done = {"init": {"condition": "service_completed_successfully"}}
    apiserver_up = {"kube-apiserver": {"condition": "service_healthy"}}
    base = {"network_mode": "host", "restart": "unless-stopped", "init": True}
    kcm_kc = kc / f"{certs.KUBE_CONTROLLER_MANAGER.file_stem}.kubeconfig"
    sched_kc = kc / f"{certs.KUBE_SCHEDULER.file_stem}.kubeconfig"
    return {
        "init": {
            "image": KUBELOOP_IMAGE,
            "build": {
                "context": ".",
                "network": "host",
                "args": {"BASE_IMAGE": f"${{BASE_IMAGE:-{DEFAULT_BASE_IMAGE}}}"},
            },
            "network_mode": "host",
            "user": "0",
            "command": ["python", "-m", "localstack.compose", "init", *_mode_args(mode)],
            "volumes": [
                f"config:{CONFIG}",
                f"tools:{TOOLS}",
                f"${{KUBELOOP_COMPOSE_HOME:-./.kubeloop/compose}}:{OUT}",
            ],
            "restart": "no",
        },
        "etcd": {
            **base,
            "image": img["etcd"],
            "entrypoint": [
                "etcd",
                "--name=kubeloop",
                "--data-dir=/var/lib/etcd",
                f"--listen-client-urls={ETCD}",
                f"--advertise-client-urls={ETCD}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=kubeloop={peer}",
                "--initial-cluster-state=new",
                "--log-level=warn",
            ],
            "volumes": ["etcd-data:/var/lib/etcd"],
            "healthcheck": {
                "test": ["CMD", "etcdctl", f"--endpoints={ETCD}", "endpoint", "health"],
                **HEALTH,
            },
        },
        "kube-apiserver": {
            **base,
            "image": img["kube-apiserver"],
            "entrypoint": [
                "kube-apiserver",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={PORTS.apiserver}",
                f"--cert-dir={pki}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--requestheader-client-ca-file={pki / 'front-proxy' / 'ca.crt'}",
                f"--requestheader-allowed-names={certs.FRONT_PROXY_CLIENT.user}",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki / 'front-proxy' / 'client-front-proxy-client.crt'}",
                f"--proxy-client-key-file={pki / 'front-proxy' / 'client-front-proxy-client.key'}",
                "--authorization-mode=Node,RBAC",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                f"--etcd-servers={ETCD}",
                "--endpoint-reconciler-type=none",
                "--profiling=false",
            ],
            "volumes": [cfg_ro, tools_ro],
            "depends_on": {**init_done, "etcd": {"condition": "service_healthy"}},
            "healthcheck": _kubectl_health(f"--kubeconfig={CONFIG / 'kubeconfig'}", "get", "--raw=/readyz"),
        },
        "kube-controller-manager": {
            **base,
            "image": img["kube-controller-manager"],
            "entrypoint": [
                "kube-controller-manager",
                f"--controllers={KCM_CONTROLLERS}",
                f"--kubeconfig={kcm_kc}",
                f"--authentication-kubeconfig={kcm_kc}",
                f"--authorization-kubeconfig={kcm_kc}",
                "--use-service-account-credentials",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                "--bind-address=127.0.0.1",
                f"--secure-port={PORTS.kube_controller_manager}",
                f"--tls-cert-file={pki / 'kube-controller-manager-serving.crt'}",
                f"--tls-private-key-file={pki / 'kube-controller-manager-serving.key'}",
                "--leader-elect=false",
                "--profiling=false",
            ],
            "volumes": [cfg_ro, tools_ro],
            "depends_on": apiserver_up,
            "healthcheck": _kubectl_health(
                f"--kubeconfig={kcm_kc}",
                f"--server=https://127.0.0.1:{PORTS.kube_controller_manager}",
                "get",
                "--raw=/healthz",
            ),
        },
        "kube-scheduler": {
            **base,
            "image": img["kube-scheduler"],
            "entrypoint": [
                "kube-scheduler",
                f"--kubeconfig={sched_kc}",
                f"--authentication-kubeconfig={sched_kc}",
                f"--authorization-kubeconfig={sched_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={PORTS.kube_scheduler}",
                f"--tls-cert-file={pki / 'kube-scheduler-serving.crt'}",
                f"--tls-private-key-file={pki / 'kube-scheduler-serving.key'}",
                "--leader-elect=false",
                "--profiling=false",
            ],
            "volumes": [cfg_ro, tools_ro],
            "depends_on": apiserver_up,
            "healthcheck": _kubectl_health(
                f"--kubeconfig={sched_kc}",
                f"--server=https://127.0.0.1:{PORTS.kube_scheduler}",
                "get",
                "--raw=/healthz",
            ),
        },
        "setup": {
            "image": KUBELOOP_IMAGE,
            "network_mode": "host",
            "command": ["python", "-m", "localstack.compose", "setup", *_mode_args(mode)],
            "volumes": [cfg_ro],
            "user": "0",
            "depends_on": apiserver_up,
            "restart": "on-failure:5",
        },
    }


def _mode_args(mode: PoolMode) -> list[str]:
    return [] if mode == SHARED else [f"--pools={mode}"]


def _component_service(
    inst: Instance, mode: PoolMode, capacity: PoolCapacity
) -> tuple[dict[str, Any], list[str]]:
    """One registry instance as a compose service, and the named volumes it uses."""
    comp = inst.component
    ctx = context(inst, capacity)
    volumes: list[str] = []
    named: list[str] = []
    if comp.identity is not None:
        volumes.append(f"config:{CONFIG}:ro")
    controller_dir = HOME / "components" / "csi-driver-controller"
    if comp.name == "csi-driver-controller" or _needs_controller_socket(comp):
        # The driver's state and its socket, shared by the controller-side sidecars.
        volumes.append(f"csi-controller:{controller_dir}")
        named.append("csi-controller")
    if comp.name != "csi-driver-controller" and comp.name not in NON_ROOT:
        # What a root component keeps in its state directory survives a restart.
        vol = f"{inst.name}-state"
        volumes.append(f"{vol}:{ctx.state_dir}")
        named.append(vol)
    if comp.name.startswith("csi-driver"):
        if mode == NODE_LOCAL:  # each node its own pool volume, which no other container mounts
            pool, pool_dir = f"pool-{inst.node}", node_pool_dir(HOME, str(inst.node))
        else:
            pool, pool_dir = "pool", shared_pool_dir(HOME)
        volumes.append(f"{pool}:{pool_dir}")
        named.append(pool)
    depends: dict[str, Any] = {"setup": {"condition": "service_completed_successfully"}}
    if comp.name != "csi-driver-controller" and _needs_controller_socket(comp):
        depends["csi-driver-controller"] = {"condition": "service_healthy"}
    service: dict[str, Any] = {
        "image": KUBELOOP_IMAGE,
        "network_mode": "host",
        "restart": "unless-stopped",
        "init": True,
        "command": container_argv(comp.argv(ctx)),
    }
    if comp.name in GO_IMAGES:
        service["image"] = images()[comp.name]
        service["command"] = comp.argv(ctx)[1:]
    if comp.env is not None:
        service["environment"] = comp.env(ctx)
    if inst.node is not None:
        # The node's directory (its kubelet root and its plugin's socket) is shared by the node plugin
        # and the node agent; rshared carries the plugin's mounts over to the agent.
        # The node's other services (its agent; node-local: its provisioner and resizer) use its
        # plugin's socket there.
        volumes.append(f"./.kubeloop/compose/nodes/{inst.node}:{HOME / 'nodes' / inst.node}:rshared")
        if comp.name != "csi-driver-node":
            depends[f"csi-driver-node-{inst.node}"] = {"condition": "service_healthy"}
        if comp.name == "node-agent":
            # Compose stops a service before those it depends on, so the agent unmounts its node's
            # volumes through a plugin that still runs; it gets the time `make up` gives a process.
            service["stop_grace_period"] = NODE_AGENT_STOP_GRACE
    if comp.name == "csi-driver-node":
        service["privileged"] = True
        volumes.append("/dev:/dev")
    if comp.name in NON_ROOT:
        service["user"] = str(NONROOT)
    else:
        service["user"] = "0"
        caps = ROOT_CAPS.get(comp.name)
        if caps is not None:
            service["cap_drop"] = ["ALL"]
            if caps:
                service["cap_add"] = caps
    service["volumes"] = volumes
    service["depends_on"] = depends
    port = instance_port(inst)
    if comp.health_path is not None and port is not None and comp.name not in GO_IMAGES:
        service["healthcheck"] = {"test": ["CMD", "bash", "-c", http_probe(port, comp.health_path)], **HEALTH}
    return service, named


HEADER = """\
# GENERATED by `python -m localstack.compose generate` from localstack/components.py's REGISTRY
# (tests/unit/test_compose_file.py fails when this file and the registry disagree). Do not edit.
#
# The whole kubeloop stack, one process per service, on host networking. `docker-compose up` starts
# it once the images exist (`make images` builds them here, or `docker-compose up --build` with a
# registry); the admin kubeconfig lands in ./.kubeloop/compose/kubeconfig. See docs/compose.md.
"""

NODE_LOCAL_HEADER = """\
# GENERATED by `python -m localstack.compose generate --pools node-local` from localstack/components.py's
# NODE_LOCAL_REGISTRY (tests/unit/test_compose_node_local_file.py fails when they disagree). Do not edit.
#
# The kubeloop stack with node-local pools: each node its own pool volume, its plugin serving
# controller and node, its own provisioner and resizer; no volume is shared between nodes. Start it
# under its own project name (its etcd and pools are not the shared stack's):
#   docker-compose -p kubeloop-node-local -f docker-compose.node-local.yml up -d
# See docs/compose.md.
"""


def compose_document(mode: PoolMode = SHARED, capacity: PoolCapacity | None = None) -> dict[str, Any]:
    img = images()
    services = _control_plane_services(img, mode)
    volumes: dict[str, dict[str, Any]] = {"config": {}, "tools": {}, "etcd-data": {}}
    for inst in instances(registry(mode), NODES):
        service, named = _component_service(inst, mode, capacity or PoolCapacity())
        services[inst.name] = service
        for vol in named:
            volumes.setdefault(vol, {})
    return {"services": services, "volumes": volumes}


def render(mode: PoolMode = SHARED, capacity: PoolCapacity | None = None) -> str:
    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    doc = compose_document(mode, capacity)
    body = yaml.dump(doc, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=200)
    return (HEADER if mode == SHARED else NODE_LOCAL_HEADER) + body


# --- the one-shot commands --------------------------------------------------------------------------


def init(mode: PoolMode = SHARED, out: Path = OUT) -> None:
    """Certificates and kubeconfigs into the `config` volume (reused while valid, like `make up`),
    non-root components' kubeconfigs owned by them, the admin kubeconfig copied to the host."""
    stack = certs.ensure_stack_certs(
        CONFIG / "pki",
        SERVER,
        CONFIG / "kubeconfigs",
        admin_kubeconfig=CONFIG / "kubeconfig",
        extra_identities=component_identities(mode),
    )
    os.chmod(CONFIG, 0o711)
    os.chmod(CONFIG / "kubeconfigs", 0o711)  # traverse only: each file is 0600 to its owner
    for comp in registry(mode):
        if comp.identity is not None:
            uid = NONROOT if comp.name in NON_ROOT else 0
            os.chown(stack.kubeconfigs[comp.identity], uid, uid)
    if out.is_dir():
        shutil.copyfile(CONFIG / "kubeconfig", out / "kubeconfig.tmp")
        os.chmod(out / "kubeconfig.tmp", 0o600)
        os.replace(out / "kubeconfig.tmp", out / "kubeconfig")
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        sys.exit("init: kubectl is not in the image")
    TOOLS.mkdir(exist_ok=True)
    shutil.copyfile(kubectl, TOOLS / "kubectl.tmp")
    os.chmod(TOOLS / "kubectl.tmp", 0o755)
    os.replace(TOOLS / "kubectl.tmp", TOOLS / "kubectl")
    print(f"init: certificates and kubeconfigs ready for {SERVER}", flush=True)


def manifests(mode: PoolMode = SHARED) -> list[str]:
    seen: list[str] = []
    for comp in registry(mode):
        for m in comp.manifests:
            if m not in seen:
                seen.append(m)
    return seen


def _pool_mode_problem(kubectl: list[str], mode: PoolMode) -> str | None:
    """Why this cluster's CSIDriver cannot serve `mode` (a project's etcd made for the other one)."""
    got = subprocess.run(
        [*kubectl, "get", "csidriver", DRIVER_NAME, "-o", "json", "--ignore-not-found"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return csidriver_conflict(json.loads(got) if got.strip() else None, mode)


def apply_crds(kubectl: list[str], crds: Path, attempts: int) -> None:
    """The VolumeSnapshot and VolumeGroupSnapshot CRDs the image carries, applied and Established
    before the manifests (the VolumeSnapshotClass among them) that need them."""
    files = [f"--filename={p}" for p in sorted(crds.glob("*.yaml"))]
    if not files:
        sys.exit(f"setup: no CRDs in {crds}; rebuild the image (tools/build-images.sh)")
    for attempt in range(attempts):
        applied = subprocess.run(
            [*kubectl, "apply", "--server-side", "--force-conflicts", *files],
            capture_output=True,
            text=True,
            check=False,
        )
        if applied.returncode == 0:
            subprocess.run(
                [*kubectl, "wait", "--for=condition=established", "--timeout=60s", *files], check=True
            )
            return
        print(f"setup: applying the CRDs failed (attempt {attempt + 1}):\n{applied.stderr}", file=sys.stderr)
        time.sleep(1)
    sys.exit(1)


def setup(mode: PoolMode = SHARED, root: Path = MANIFESTS, attempts: int = 30) -> None:
    """Applies every component's manifests as admin, in registry order, as the pool mode needs them
    (what `make up` does)."""
    kubectl = ["kubectl", f"--kubeconfig={CONFIG / 'kubeconfig'}"]
    apply_crds(kubectl, root / "crds", attempts)
    docs = manifests_for_mode(((root / m).read_text() for m in manifests(mode)), mode)
    stream = yaml.safe_dump_all(docs, sort_keys=False)
    for attempt in range(attempts):
        try:
            problem = _pool_mode_problem(kubectl, mode)
        except subprocess.CalledProcessError as e:
            print(
                f"setup: reading the CSIDriver failed (attempt {attempt + 1}):\n{e.stderr}", file=sys.stderr
            )
            time.sleep(1)
            continue
        if problem is not None:
            sys.exit(f"setup: {problem} (with docker-compose: another project name, -p, or down -v)")
        result = subprocess.run(
            [*kubectl, "apply", "-f", "-"], input=stream, capture_output=True, text=True, check=False
        )
        if result.returncode == 0:
            print(result.stdout, end="", flush=True)
            return
        print(f"setup: kubectl apply failed (attempt {attempt + 1}):\n{result.stderr}", file=sys.stderr)
        time.sleep(1)
    sys.exit(1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m localstack.compose", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate", help="print docker-compose.yml (with --pools node-local: docker-compose.node-local.yml)"
    )
    init_cmd = sub.add_parser(
        "init", help="the init service: certificates, kubeconfigs, kubectl for healthchecks"
    )
    setup_cmd = sub.add_parser("setup", help="the setup service: apply the components' manifests as admin")
    for cmd in (gen, init_cmd, setup_cmd):
        cmd.add_argument(
            "--pools", choices=POOL_MODES, default=SHARED, help=f"the pool mode (default: {SHARED})"
        )
    gen.add_argument(
        "--pool-capacity",
        default="",
        metavar="SIZE|NODE=SIZE,...",
        help="the size each pool offers, as `make up --pool-capacity` (default: the pool's free space)",
    )
    ns = parser.parse_args(argv)
    if ns.command == "generate":
        try:
            capacity = parse_pool_capacity(ns.pool_capacity, ns.pools, NODES)
        except PoolOptionError as e:
            parser.error(str(e))
        sys.stdout.write(render(ns.pools, capacity))
    elif ns.command == "init":
        init(ns.pools)
    elif ns.command == "setup":
        setup(ns.pools)


if __name__ == "__main__":
    main()
