"""`kubeloop-external-provisioner`: the kubernetes-csi external-provisioner sidecar."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from controller_runtime import goflags, process
from controller_runtime.client import ApiClient
from controller_runtime.component import Controller, api_client, run_elected
from controller_runtime.controller import ControllerContext
from controller_runtime.csi_client import CSIConnection, error_text
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.logs import get_logger
from controller_runtime.resources import CSI_NODES, NODES, STORAGE_CLASSES, Obj
from kubeloop_grpc.csi import csi_pb2

from . import names, owner
from .capacity import CapacityOptions, CapacityPublisher
from .clone_protection import CloneProtectionController
from .deletion import DeletionController
from .journal import Journal
from .node_deployment import NodeDeployment
from .options import Options
from .provisioning import ProvisioningController
from .snapshot_protection import SnapshotProtectionController

log = get_logger("external-provisioner")


# The counterpart whose command line this one takes (tools/versions.env's EXTERNAL_PROVISIONER_VERSION).
UPSTREAM = "external-provisioner v6.3.0"


def build_parser() -> goflags.FlagSet:
    """Every flag of upstream's csi-provisioner, parsed as its spf13/pflag does, and kubeloop's own
    (docs/sidecar-flags.md)."""
    flags = goflags.controller_sidecar(
        "kubeloop-external-provisioner",
        "Provisions and deletes volumes of a CSI driver for PersistentVolumeClaims "
        "(kubernetes-csi external-provisioner).",
        goflags.Syntax.PFLAG,
        UPSTREAM,
    )
    Flag, S = goflags.Flag, goflags.Support
    flags.add(
        goflags.PPROF,
        goflags.MASTER,
        *goflags.retry_flags(),
        Flag("timeout", "duration", "10s", "timeout of each CSI call"),
        Flag("worker-threads", "uint", "100", "concurrent provisioning and deletion syncs"),
        Flag("volume-name-prefix", "string", "pvc", "prefix of PV and CreateVolume names"),
        Flag(
            "volume-name-uuid-length",
            "int",
            "-1",
            "cut the claim UID in volume names to this many characters, dashes removed",
            S.REFUSED,
            "kubeloop names every volume <prefix>-<claim UID>",
        ),
        Flag("default-fstype", "string", "", "filesystem when the class sets no csi.storage.k8s.io/fstype"),
        Flag(
            "extra-create-metadata",
            "bool",
            "false",
            "pass csi.storage.k8s.io/pvc/name, pvc/namespace and pv/name to CreateVolume",
        ),
        Flag(
            "strict-topology",
            "bool",
            "false",
            "late binding: pass only the selected node's topology to CreateVolume, not every segment of "
            "the cluster with the selected node's first",
        ),
        Flag(
            "immediate-topology",
            "bool",
            "true",
            "immediate binding: pass every segment where the driver runs to CreateVolume (true) or no "
            "topology requirement (false)",
        ),
        Flag(
            "prevent-volume-mode-conversion",
            "bool",
            "true",
            "refuse to restore a VolumeSnapshot into a claim of another volumeMode than the snapshotted "
            "volume's unless its VolumeSnapshotContent carries "
            'snapshot.storage.kubernetes.io/allow-volume-mode-change: "true"',
        ),
        Flag(
            "controller-publish-readonly",
            "bool",
            "false",
            "mark the PV's CSI source readOnly when the claim asks for ReadOnlyMany alone",
            S.REFUSED,
            "kubeloop's PVs are never marked readOnly for ControllerPublishVolume",
        ),
        Flag(
            "snapshot-orphan-sweep-interval",
            "duration",
            "5m0s",
            "how often snapshots no pending claim restores from lose their source protection; 0 disables",
        ),
        Flag(
            "cloning-protection-threads",
            "uint",
            "1",
            "concurrent removals of the clone source finalizer",
            S.IGNORED,
            "kubeloop's clone protection removes finalizers in one pass per claim event",
        ),
        # Distributed provisioning.
        Flag(
            "node-deployment",
            "bool",
            "false",
            "run beside the driver on every node (node name from $NODE_NAME) and serve that node's "
            "claims and volumes only",
        ),
        Flag(
            "node-deployment-immediate-binding",
            "bool",
            "true",
            "in node deployment, let the nodes' provisioners elect one of them for claims with "
            "Immediate binding",
        ),
        Flag(
            "node-deployment-base-delay",
            "duration",
            "20s",
            "in node deployment, the first wait (0 to this, at random) before trying to own an "
            "Immediate claim",
        ),
        Flag(
            "node-deployment-max-delay",
            "duration",
            "1m0s",
            "in node deployment, the longest wait before trying to own an Immediate claim",
        ),
        # Storage capacity.
        Flag("enable-capacity", "bool", "false", "publish CSIStorageCapacity objects"),
        Flag("capacity-poll-interval", "duration", "1m0s", "GetCapacity period"),
        # Upstream gives capacity publishing a client of its own, rate-limited apart: its writes (a
        # round per new class or node) must not queue in front of provisioning and its events.
        Flag(
            "kube-api-capacity-qps",
            "float32",
            "1",
            "QPS of the client that writes CSIStorageCapacity objects",
        ),
        Flag(
            "kube-api-capacity-burst",
            "int",
            "5",
            "burst of the client that writes CSIStorageCapacity objects",
        ),
        Flag(
            "capacity-for-immediate-binding",
            "bool",
            "false",
            "also publish capacity for classes with Immediate binding",
        ),
        Flag(
            "capacity-threads",
            "uint",
            "1",
            "concurrent CSIStorageCapacity updates",
            S.IGNORED,
            "kubeloop's publisher writes its objects in one loop",
        ),
        Flag(
            "capacity-ownerref-level",
            "int",
            "1",
            "the owner of the CSIStorageCapacity objects, counted up from the pod named by $POD_NAME in "
            "$NAMESPACE: -1 none, 0 the pod, 1 its DaemonSet or StatefulSet, 2 a Deployment",
        ),
        # kubeloop's own.
        Flag(
            "capacity-namespace",
            "string",
            os.environ.get("NAMESPACE", "kube-system"),
            "namespace of the CSIStorageCapacity objects (upstream's is $NAMESPACE; kubeloop's default is "
            "$NAMESPACE or kube-system)",
            S.OWN,
        ),
        Flag(
            "state-dir",
            "string",
            "/var/lib/kubeloop/external-provisioner",
            "where the intent journal lives; keep it with the driver's state",
            S.OWN,
        ),
        Flag(
            "resync-period",
            "duration",
            "15m0s",
            "how often every claim and volume is looked at again (upstream's is fixed at 15m)",
            S.OWN,
        ),
    )
    flags.add_gates(
        goflags.Gate(
            "Topology",
            True,
            "GA",
            kubeloop=True,
            why="kubeloop's provisioner always passes the topology of where the driver runs",
        ),
        goflags.Gate(
            "VolumeAttributesClass",
            True,
            "GA",
            kubeloop=True,
            why="kubeloop's provisioner always passes a claim's VolumeAttributesClass parameters",
        ),
        goflags.Gate(
            "CrossNamespaceVolumeDataSource",
            False,
            "ALPHA",
            kubeloop=False,
            why="kubeloop provisions from data sources in the claim's own namespace only",
        ),
        goflags.RELEASE_ON_EXIT,
        *goflags.apiserver_gates("v0.36"),
    )
    return flags


def provisioner_identity(driver: str) -> str:
    """Upstream's identity format: start time in ms, a random number, the driver name."""
    return f"{int(time.time() * 1000)}-{random.randrange(10000)}-{driver}"


def lease_name(driver: str) -> str:
    return re.sub(r"[^a-zA-Z0-9-]", "-", driver)


def controller_options(args: argparse.Namespace, driver: str, node: NodeDeployment | None) -> Options:
    identity = provisioner_identity(driver)
    return Options(
        # Upstream's identity names the node too in node deployment.
        identity=f"{identity}-{node.node_name}" if node is not None else identity,
        prefix=args.volume_name_prefix,
        default_fs=args.default_fstype,
        extra_metadata=args.extra_create_metadata,
        workers=max(1, args.worker_threads),
        retry_start=args.retry_interval_start,
        retry_max=args.retry_interval_max,
        snapshot_sweep_interval=args.snapshot_orphan_sweep_interval,
        strict_topology=args.strict_topology,
        immediate_topology=args.immediate_topology,
        prevent_mode_conversion=args.prevent_volume_mode_conversion,
        node_deployment=node,
    )


class StartError(Exception):
    """A flag or environment setting the process cannot run with; its text says which."""


def check_environment(args: argparse.Namespace) -> str | None:
    """Refuses, before anything is connected, flags and environment that cannot work together;
    returns $NODE_NAME for --node-deployment (None without it)."""
    if args.enable_capacity and args.capacity_ownerref_level >= 0:
        if not os.environ.get("POD_NAME"):
            raise StartError("need POD_NAME env variable to determine CSIStorageCapacity owner")
        # The pod is looked up where the objects live: an owner reference cannot cross namespaces
        # (the garbage collector would delete such objects at once), and upstream has no other.
        pod_namespace = os.environ.get("NAMESPACE", args.capacity_namespace)
        if pod_namespace != args.capacity_namespace:
            raise StartError(
                f"--capacity-ownerref-level={args.capacity_ownerref_level} needs the CSIStorageCapacity "
                f"objects in the pod's namespace {pod_namespace!r}, not {args.capacity_namespace!r}"
            )
    if not args.node_deployment:
        return None
    name = os.environ.get("NODE_NAME", "")
    if not name:
        raise StartError("The NODE_NAME environment variable must be set when using --node-deployment.")
    if args.leader_election:
        # One Lease for the driver would leave a single node serving every node's claims.
        raise StartError(
            "--leader-election cannot be used with --node-deployment: "
            "each node's provisioner serves its own node"
        )
    return name


async def node_deployment(args: argparse.Namespace, conn: CSIConnection, name: str) -> NodeDeployment:
    """This node as its driver describes it (NodeGetInfo), as upstream asks at start."""
    try:
        info = await conn.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=conn.timeout)
    except grpc.aio.AioRpcError as exc:
        raise StartError(f"Failed to get node info from CSI driver: {error_text(exc)}") from exc
    segment = dict(info.accessible_topology.segments) if info.HasField("accessible_topology") else {}
    log.info("node deployment", node=name, node_id=info.node_id, topology=segment)
    return NodeDeployment(
        node_name=name,
        node_id=info.node_id,
        segment=segment,
        immediate_binding=args.node_deployment_immediate_binding,
        base_delay=args.node_deployment_base_delay,
        max_delay=args.node_deployment_max_delay,
    )


async def capacity_owner(args: argparse.Namespace, client: ApiClient) -> Obj | None:
    """The owner reference of the CSIStorageCapacity objects (--capacity-ownerref-level)."""
    if args.capacity_ownerref_level < 0:
        return None
    pod = os.environ["POD_NAME"]  # check_environment made sure
    try:
        ref = await owner.lookup(client, args.capacity_namespace, pod, args.capacity_ownerref_level)
    except owner.OwnerLookupError as exc:
        raise StartError(f"look up owner(s) of pod: {exc}") from exc
    log.info(
        "owner of CSIStorageCapacity objects",
        api_version=ref["apiVersion"],
        kind=ref["kind"],
        name=ref["name"],
    )
    return ref


def capacity_publisher(
    args: argparse.Namespace,
    client: ApiClient,
    conn: CSIConnection,
    factory: SharedInformerFactory,
    node: NodeDeployment | None,
    owner_ref: Obj | None,
    recorder: EventRecorder,
) -> CapacityPublisher:
    """The publisher of CSIStorageCapacity objects, on the controllers' caches (its handlers are
    added before they start) and its own client. In node deployment it publishes this node's
    segment alone and watches no Node or CSINode, as upstream."""
    return CapacityPublisher(
        client,
        conn,
        factory.informer(STORAGE_CLASSES),
        factory.informer(CSI_NODES) if node is None else None,
        factory.informer(NODES) if node is None else None,
        CapacityOptions(
            namespace=args.capacity_namespace,
            interval=args.capacity_poll_interval,
            immediate_binding=args.capacity_for_immediate_binding,
            managed_by=names.capacity_managed_by(node.node_name if node is not None else None),
            fixed_segment=node.segment if node is not None else None,
            owner=owner_ref,
        ),
        recorder,
    )


async def run_controllers(
    journal: Journal,
    provisioning: ProvisioningController,
    others: Sequence[Controller],
) -> None:
    """Every controller, on one informer factory, once this process owns the intent journal (a
    second one on the same state directory, such as a restart whose predecessor still exits,
    waits rather than act beside it). The journal is read before the informers start: the claim
    events of the first list must see its entries."""
    await journal.lock.acquire(lambda holder: log.warning("waiting for the journal", holder=holder))
    try:
        await provisioning.load_journal()
        try:
            await provisioning.start_informers()
            await asyncio.gather(provisioning.run(), *(c.run() for c in others))
        finally:
            await provisioning.factory.stop()
    finally:
        journal.close()
        journal.lock.release()


async def run(args: argparse.Namespace, ctx: process.Context) -> None:
    state: dict[str, ProvisioningController | CSIConnection] = {}

    def ready() -> str | None:
        if "conn" not in state:
            return "CSI driver not connected"
        prov = state.get("provisioner")
        if args.leader_election and prov is None:
            return None  # a standby is ready: it serves nothing until it leads
        if not isinstance(prov, ProvisioningController) or not prov.synced:
            return "caches not synced"
        return None

    if ctx.health is not None:
        ctx.health.add_liveness_check("ping", lambda: None)
        ctx.health.add_readiness_check("provisioner", ready)

    try:
        name = check_environment(args)
    except StartError as exc:
        raise SystemExit(f"kubeloop-external-provisioner: {exc}") from exc
    conn = await CSIConnection.connect(args.csi_address, timeout=args.timeout)
    state["conn"] = conn
    # A driver without CONTROLLER_SERVICE / CREATE_DELETE_VOLUME still runs, as upstream: every
    # claim's ProvisioningFailed event says what is missing.
    client = await api_client(args, "kubeloop-external-provisioner")
    recorder = EventRecorder(client, f"{conn.driver_name}_{socket.gethostname()}", queue_size=10000)
    capacity_client = (
        await ApiClient.from_kubeconfig(
            args.kubeconfig or None,
            qps=args.kube_api_capacity_qps,
            burst=args.kube_api_capacity_burst,
            user_agent="kubeloop-external-provisioner",
        )
        if args.enable_capacity
        else None
    )

    try:
        node = await node_deployment(args, conn, name) if name is not None else None
        owner_ref = await capacity_owner(args, client) if capacity_client is not None else None
    except StartError as exc:
        await asyncio.gather(recorder.close(), client.close(), conn.close())
        if capacity_client is not None:
            await capacity_client.close()
        raise SystemExit(f"kubeloop-external-provisioner: {exc}") from exc

    async def lead() -> None:
        factory = SharedInformerFactory(client, resync_period=args.resync_period)
        context = ControllerContext(client, factory, recorder)
        options = controller_options(args, conn.driver_name, node)  # a new identity each term
        journal = Journal(Path(args.state_dir) / "provisioning")
        publisher = (
            capacity_publisher(args, capacity_client, conn, factory, node, owner_ref, recorder)
            if capacity_client is not None
            else None
        )
        # In node deployment a created or deleted volume changes the one segment published: it is
        # refreshed at once, as upstream's provision wrapper does. A central publisher would ask
        # for every segment of the cluster each time, so it keeps to its poll (see "Not done").
        changed = publisher.refresh_soon if publisher is not None and node is not None else None
        clones = CloneProtectionController(context, conn, options)
        snapshots = SnapshotProtectionController(context, conn, options)
        provisioning = ProvisioningController(
            context, conn, journal, options, clones, snapshots, volume_created=changed
        )
        deletion = DeletionController(context, conn, options, volume_deleted=changed)
        state["provisioner"] = provisioning
        tasks = [
            asyncio.create_task(
                run_controllers(journal, provisioning, [deletion, clones, snapshots]), name="provisioner"
            )
        ]
        if publisher is not None:
            capacity = publisher

            async def publish() -> None:
                await factory.wait_for_sync()
                await capacity.run()

            tasks.append(asyncio.create_task(publish(), name="capacity"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    try:
        await run_elected(args, client, lease_name(conn.driver_name), lead)
    finally:
        await recorder.close()
        await client.close()
        if capacity_client is not None:
            await capacity_client.close()
        await conn.close()


def main(argv: Sequence[str] | None = None) -> None:
    goflags.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
