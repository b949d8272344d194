"""A small CSI driver with bugs to switch on, one at a time, for the driver bench's tests
(docs/driver-bench.md): `python -m tests.driver_bench.buggy_driver --endpoint unix:///s --state-dir
D --node-id N`, the bug named by BUGGY_DRIVER_BUG (none when unset).

Volumes are directories under the state directory, snapshots copies of them, stage and publish
bind mounts; an index file records volumes, snapshots and names. With no bug it is a correct
driver (the campaign finds nothing); each bug is one a CSI driver really ships with:

- duplicate-create: CreateVolume checks the name, then provisions, then records, with nothing
  holding a second call of the same name off in between: two at once make two volumes.
- memory-state: the index lives in memory only; a restart forgets every volume.
- republish-fails: NodePublishVolume on a target already published answers ALREADY_EXISTS
  instead of OK, so a retry after a lost answer never succeeds.
- delete-timeout-leak: DeleteVolume forgets the volume first and removes its data after a slow
  backend call; a call cancelled in between (the caller's deadline) leaves the data for good.
- unstage-leaves-mount: NodeUnstageVolume forgets the staging but leaves it mounted."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from controller_runtime.mounts import read_mounts
from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc

NAME = "buggy.csi.bench.kubeloop.dev"
BUGS = ("duplicate-create", "memory-state", "republish-fails", "delete-timeout-leak", "unstage-leaves-mount")
# The backend's slow calls: long enough for the bench's timeout fault (0.1 s) to land inside.
PROVISION_SECONDS = 0.05
DELETE_SECONDS = 0.3

T = TypeVar("T")


class Driver:
    def __init__(self, state: Path, node_id: str, bug: str) -> None:
        self.state, self.node_id, self.bug = state, node_id, bug
        self.index_file = state / "index.json"
        self.lock = asyncio.Lock()
        self.index: dict[str, dict[str, Any]] = {"volumes": {}, "snapshots": {}}
        if bug != "memory-state" and self.index_file.exists():
            self.index = json.loads(self.index_file.read_text())
        for kind in ("volumes", "snapshots"):
            (state / kind).mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        if self.bug == "memory-state":
            return
        tmp = self.index_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.index))
        os.replace(tmp, self.index_file)

    def volume_dir(self, volume_id: str) -> Path:
        return self.state / "volumes" / volume_id

    def snapshot_dir(self, snapshot_id: str) -> Path:
        return self.state / "snapshots" / snapshot_id

    def by_name(self, kind: str, name: str) -> str | None:
        return next((i for i, r in self.index[kind].items() if r["name"] == name), None)


def mounted(path: str) -> bool:
    return any(m.mountpoint == path for m in read_mounts())


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


async def abort(context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode, details: str) -> None:
    await context.abort(code, details)


class Identity(csi_pb2_grpc.IdentityServicer):  # type: ignore[misc]
    async def GetPluginInfo(self, request: Any, context: Any) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name=NAME, vendor_version="0.1")

    async def GetPluginCapabilities(
        self, request: Any, context: Any
    ) -> csi_pb2.GetPluginCapabilitiesResponse:
        service = csi_pb2.PluginCapability.Service
        return csi_pb2.GetPluginCapabilitiesResponse(
            capabilities=[csi_pb2.PluginCapability(service=service(type=service.CONTROLLER_SERVICE))]
        )

    async def Probe(self, request: Any, context: Any) -> csi_pb2.ProbeResponse:
        return csi_pb2.ProbeResponse()


class Controller(csi_pb2_grpc.ControllerServicer):  # type: ignore[misc]
    def __init__(self, d: Driver) -> None:
        self.d = d

    async def _serialized(self, work: Callable[[], Awaitable[T]]) -> T:
        # The correct driver holds one lock over check-then-create; duplicate-create does not.
        if self.d.bug == "duplicate-create":
            return await work()
        async with self.d.lock:
            return await work()

    async def CreateVolume(self, request: Any, context: Any) -> csi_pb2.CreateVolumeResponse:
        d = self.d

        async def create() -> csi_pb2.CreateVolumeResponse:
            existing = d.by_name("volumes", request.name)
            if existing is None:
                await asyncio.sleep(PROVISION_SECONDS)  # the backend provisioning
                existing = uuid.uuid4().hex[:12]
                source = request.volume_content_source.snapshot.snapshot_id
                if source:
                    if source not in d.index["snapshots"]:
                        await abort(context, grpc.StatusCode.NOT_FOUND, f"snapshot {source}")
                    shutil.copytree(d.snapshot_dir(source), d.volume_dir(existing))
                else:
                    d.volume_dir(existing).mkdir()
                d.index["volumes"][existing] = {
                    "name": request.name,
                    "capacity": request.capacity_range.required_bytes,
                    "source": source,
                }
                d.save()
            record = d.index["volumes"][existing]
            return csi_pb2.CreateVolumeResponse(
                volume=csi_pb2.Volume(
                    volume_id=existing,
                    capacity_bytes=record["capacity"],
                    content_source=request.volume_content_source if record["source"] else None,
                )
            )

        return await self._serialized(create)

    async def DeleteVolume(self, request: Any, context: Any) -> csi_pb2.DeleteVolumeResponse:
        d, volume_id = self.d, request.volume_id
        if self.d.bug == "delete-timeout-leak":
            # Forgotten first, so a retry finds nothing to delete and answers OK at once.
            if d.index["volumes"].pop(volume_id, None) is None:
                return csi_pb2.DeleteVolumeResponse()
            d.save()
            await asyncio.sleep(DELETE_SECONDS)  # the backend's delete, cancelled with the call
            shutil.rmtree(d.volume_dir(volume_id), ignore_errors=True)
            return csi_pb2.DeleteVolumeResponse()
        await asyncio.sleep(DELETE_SECONDS)
        shutil.rmtree(d.volume_dir(volume_id), ignore_errors=True)
        if d.index["volumes"].pop(volume_id, None) is not None:
            d.save()
        return csi_pb2.DeleteVolumeResponse()

    async def _volume(self, volume_id: str, context: Any) -> dict[str, Any]:
        record: dict[str, Any] | None = self.d.index["volumes"].get(volume_id)
        if record is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"volume {volume_id} not found")
        assert record is not None
        return record

    async def ControllerPublishVolume(
        self, request: Any, context: Any
    ) -> csi_pb2.ControllerPublishVolumeResponse:
        await self._volume(request.volume_id, context)
        return csi_pb2.ControllerPublishVolumeResponse(
            publish_context={"path": str(self.d.volume_dir(request.volume_id))}
        )

    async def ControllerUnpublishVolume(
        self, request: Any, context: Any
    ) -> csi_pb2.ControllerUnpublishVolumeResponse:
        return csi_pb2.ControllerUnpublishVolumeResponse()

    async def ControllerExpandVolume(
        self, request: Any, context: Any
    ) -> csi_pb2.ControllerExpandVolumeResponse:
        record = await self._volume(request.volume_id, context)
        record["capacity"] = max(record["capacity"], request.capacity_range.required_bytes)
        self.d.save()
        return csi_pb2.ControllerExpandVolumeResponse(
            capacity_bytes=record["capacity"], node_expansion_required=True
        )

    async def CreateSnapshot(self, request: Any, context: Any) -> csi_pb2.CreateSnapshotResponse:
        d = self.d

        async def create() -> csi_pb2.CreateSnapshotResponse:
            record = await self._volume(request.source_volume_id, context)
            existing = d.by_name("snapshots", request.name)
            if existing is None:
                existing = uuid.uuid4().hex[:12]
                shutil.copytree(d.volume_dir(request.source_volume_id), d.snapshot_dir(existing))
                d.index["snapshots"][existing] = {
                    "name": request.name,
                    "source": request.source_volume_id,
                    "size": record["capacity"],
                }
                d.save()
            snap = d.index["snapshots"][existing]
            return csi_pb2.CreateSnapshotResponse(
                snapshot=csi_pb2.Snapshot(
                    snapshot_id=existing,
                    source_volume_id=snap["source"],
                    size_bytes=snap["size"],
                    ready_to_use=True,
                )
            )

        return await self._serialized(create)

    async def DeleteSnapshot(self, request: Any, context: Any) -> csi_pb2.DeleteSnapshotResponse:
        shutil.rmtree(self.d.snapshot_dir(request.snapshot_id), ignore_errors=True)
        if self.d.index["snapshots"].pop(request.snapshot_id, None) is not None:
            self.d.save()
        return csi_pb2.DeleteSnapshotResponse()

    async def ControllerGetCapabilities(
        self, request: Any, context: Any
    ) -> csi_pb2.ControllerGetCapabilitiesResponse:
        rpc = csi_pb2.ControllerServiceCapability.RPC
        types = (
            rpc.CREATE_DELETE_VOLUME,
            rpc.PUBLISH_UNPUBLISH_VOLUME,
            rpc.CREATE_DELETE_SNAPSHOT,
            rpc.EXPAND_VOLUME,
        )
        return csi_pb2.ControllerGetCapabilitiesResponse(
            capabilities=[csi_pb2.ControllerServiceCapability(rpc=rpc(type=t)) for t in types]
        )


class Node(csi_pb2_grpc.NodeServicer):  # type: ignore[misc]
    def __init__(self, d: Driver) -> None:
        self.d = d

    async def NodeStageVolume(self, request: Any, context: Any) -> csi_pb2.NodeStageVolumeResponse:
        source = self.d.volume_dir(request.volume_id)
        if not source.is_dir():
            await abort(context, grpc.StatusCode.NOT_FOUND, f"volume {request.volume_id} not found")
        if not mounted(request.staging_target_path):
            run("mount", "--bind", str(source), request.staging_target_path)
        return csi_pb2.NodeStageVolumeResponse()

    async def NodeUnstageVolume(self, request: Any, context: Any) -> csi_pb2.NodeUnstageVolumeResponse:
        if self.d.bug != "unstage-leaves-mount" and mounted(request.staging_target_path):
            run("umount", request.staging_target_path)
        return csi_pb2.NodeUnstageVolumeResponse()

    async def NodePublishVolume(self, request: Any, context: Any) -> csi_pb2.NodePublishVolumeResponse:
        target = request.target_path
        if mounted(target):
            if self.d.bug == "republish-fails":
                await abort(context, grpc.StatusCode.ALREADY_EXISTS, f"{target} is already published")
            return csi_pb2.NodePublishVolumeResponse()
        os.makedirs(target, exist_ok=True)
        run("mount", "--bind", request.staging_target_path, target)
        return csi_pb2.NodePublishVolumeResponse()

    async def NodeUnpublishVolume(self, request: Any, context: Any) -> csi_pb2.NodeUnpublishVolumeResponse:
        target = request.target_path
        if mounted(target):
            run("umount", target)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(target)
        return csi_pb2.NodeUnpublishVolumeResponse()

    async def NodeExpandVolume(self, request: Any, context: Any) -> csi_pb2.NodeExpandVolumeResponse:
        return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=request.capacity_range.required_bytes)

    async def NodeGetCapabilities(self, request: Any, context: Any) -> csi_pb2.NodeGetCapabilitiesResponse:
        rpc = csi_pb2.NodeServiceCapability.RPC
        return csi_pb2.NodeGetCapabilitiesResponse(
            capabilities=[
                csi_pb2.NodeServiceCapability(rpc=rpc(type=t))
                for t in (rpc.STAGE_UNSTAGE_VOLUME, rpc.EXPAND_VOLUME)
            ]
        )

    async def NodeGetInfo(self, request: Any, context: Any) -> csi_pb2.NodeGetInfoResponse:
        return csi_pb2.NodeGetInfoResponse(node_id=self.d.node_id)


async def serve(endpoint: str, state: Path, node_id: str, bug: str) -> None:
    path = endpoint.removeprefix("unix://")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a socket left by a killed predecessor
    d = Driver(state, node_id, bug)
    server = grpc.aio.server()
    csi_pb2_grpc.add_IdentityServicer_to_server(Identity(), server)
    csi_pb2_grpc.add_ControllerServicer_to_server(Controller(d), server)
    csi_pb2_grpc.add_NodeServicer_to_server(Node(d), server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--node-id", required=True)
    args = p.parse_args()
    bug = os.environ.get("BUGGY_DRIVER_BUG", "")
    if bug and bug not in BUGS:
        raise SystemExit(f"unknown BUGGY_DRIVER_BUG {bug!r} (known: {', '.join(BUGS)})")
    asyncio.run(serve(args.endpoint, Path(args.state_dir), args.node_id, bug))


if __name__ == "__main__":
    main()
