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

from controller_runtime import process
from controller_runtime.client import ApiClient
from controller_runtime.component import Controller, api_client, run_elected
from controller_runtime.controller import ControllerContext
from controller_runtime.csi_client import CSIConnection
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.logs import get_logger
from controller_runtime.resources import CSI_NODES, NODES, STORAGE_CLASSES

from .capacity import CapacityOptions, CapacityPublisher
from .clone_protection import CloneProtectionController
from .deletion import DeletionController
from .journal import Journal
from .options import Options
from .provisioning import ProvisioningController
from .snapshot_protection import SnapshotProtectionController

log = get_logger("external-provisioner")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubeloop-external-provisioner",
        description="Provisions and deletes volumes of a CSI driver for PersistentVolumeClaims.",
    )
    parser.add_argument(
        "--csi-address", default="/run/csi/socket", help="the CSI driver's socket (default: %(default)s)"
    )
    parser.add_argument(
        "--timeout", type=process.duration, default=10.0, help="timeout of each CSI call (default: 10s)"
    )
    parser.add_argument(
        "--worker-threads",
        type=int,
        default=100,
        help="concurrent provisioning and deletion syncs (default: 100)",
    )
    process.add_retry_flags(parser)
    parser.add_argument(
        "--volume-name-prefix", default="pvc", help="prefix of PV and CreateVolume names (default: pvc)"
    )
    parser.add_argument(
        "--default-fstype", default="", help="filesystem when the class sets no csi.storage.k8s.io/fstype"
    )
    parser.add_argument(
        "--extra-create-metadata",
        action="store_true",
        help="pass csi.storage.k8s.io/pvc/name, pvc/namespace and pv/name to CreateVolume",
    )
    parser.add_argument(
        "--state-dir",
        default="/var/lib/kubeloop/external-provisioner",
        help="where the intent journal lives; keep it with the driver's state (default: %(default)s)",
    )
    parser.add_argument(
        "--snapshot-orphan-sweep-interval",
        type=process.duration,
        default=300.0,
        help="how often snapshots no pending claim restores from lose their source protection; 0 disables "
        "(default: 5m)",
    )
    cap = parser.add_argument_group("storage capacity")
    cap.add_argument("--enable-capacity", action="store_true", help="publish CSIStorageCapacity objects")
    cap.add_argument(
        "--capacity-poll-interval",
        type=process.duration,
        default=60.0,
        help="GetCapacity period (default: 1m)",
    )
    cap.add_argument(
        "--capacity-namespace",
        default=os.environ.get("NAMESPACE", "kube-system"),
        help="namespace of the CSIStorageCapacity objects (default: $NAMESPACE or kube-system)",
    )
    # Upstream gives capacity publishing a client of its own, rate-limited apart: its writes (a
    # round per new class or node) must not queue in front of provisioning and its events.
    cap.add_argument(
        "--kube-api-capacity-qps",
        type=float,
        default=1.0,
        help="QPS of the client that writes CSIStorageCapacity objects (default: %(default)s)",
    )
    cap.add_argument(
        "--kube-api-capacity-burst",
        type=int,
        default=5,
        help="burst of the client that writes CSIStorageCapacity objects (default: %(default)s)",
    )
    cap.add_argument(
        "--capacity-for-immediate-binding",
        action="store_true",
        help="also publish capacity for classes with Immediate binding",
    )
    process.add_controller_flags(
        parser,
        resync_period=900.0,
        resync_help="how often every claim and volume is looked at again (default: 15m)",
    )
    return parser


def provisioner_identity(driver: str) -> str:
    """Upstream's identity format: start time in ms, a random number, the driver name."""
    return f"{int(time.time() * 1000)}-{random.randrange(10000)}-{driver}"


def lease_name(driver: str) -> str:
    return re.sub(r"[^a-zA-Z0-9-]", "-", driver)


def controller_options(args: argparse.Namespace, driver: str) -> Options:
    return Options(
        identity=provisioner_identity(driver),
        prefix=args.volume_name_prefix,
        default_fs=args.default_fstype,
        extra_metadata=args.extra_create_metadata,
        workers=max(1, args.worker_threads),
        retry_start=args.retry_interval_start,
        retry_max=args.retry_interval_max,
        snapshot_sweep_interval=args.snapshot_orphan_sweep_interval,
    )


def capacity_publisher(
    args: argparse.Namespace, client: ApiClient, conn: CSIConnection, factory: SharedInformerFactory
) -> CapacityPublisher:
    """The publisher of CSIStorageCapacity objects, on the controllers' caches (its handlers are
    added before they start) and its own client."""
    return CapacityPublisher(
        client,
        conn,
        factory.informer(STORAGE_CLASSES),
        factory.informer(CSI_NODES),
        factory.informer(NODES),
        CapacityOptions(
            namespace=args.capacity_namespace,
            interval=args.capacity_poll_interval,
            immediate_binding=args.capacity_for_immediate_binding,
        ),
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

    async def lead() -> None:
        factory = SharedInformerFactory(client, resync_period=args.resync_period)
        context = ControllerContext(client, factory, recorder)
        options = controller_options(args, conn.driver_name)  # a new identity each term, as before
        journal = Journal(Path(args.state_dir) / "provisioning")
        clones = CloneProtectionController(context, conn, options)
        snapshots = SnapshotProtectionController(context, conn, options)
        provisioning = ProvisioningController(context, conn, journal, options, clones, snapshots)
        deletion = DeletionController(context, conn, options)
        state["provisioner"] = provisioning
        tasks = [
            asyncio.create_task(
                run_controllers(journal, provisioning, [deletion, clones, snapshots]), name="provisioner"
            )
        ]
        if capacity_client is not None:
            publisher = capacity_publisher(args, capacity_client, conn, factory)

            async def publish() -> None:
                await factory.wait_for_sync()
                await publisher.run()

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
    process.main(build_parser(), run, argv)


if __name__ == "__main__":
    main()
