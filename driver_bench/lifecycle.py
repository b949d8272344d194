"""The caller: the CSI volume lifecycle as the sidecars and kubelet drive it.

external-provisioner, -attacher, -resizer, csi-snapshotter and kubelet never give up on a call:
they retry it, with the same request, until the driver answers it. The caller here does the same
for every answer that a retry may change (the driver unreachable or restarting, a deadline, an
operation still in progress); any other error ends the lifecycle as a finding, since a sidecar
would retry it forever and the volume would be stuck.

One lifecycle: CreateVolume, ControllerPublishVolume, NodeStageVolume, NodePublishVolume, a file
written through the target, ControllerExpandVolume (and NodeExpandVolume when the driver asks for
it) and the file read back, CreateSnapshot until ready, CreateVolume from that snapshot, the
restored volume attached, its file read back and detached, NodeUnpublishVolume,
NodeUnstageVolume, ControllerUnpublishVolume, DeleteSnapshot and DeleteVolume. Steps the
driver's capabilities leave out are skipped, as the sidecars skip them."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from kubeloop_grpc.csi import csi_pb2

from . import messages
from .oracles import Finding, stacked_mounts

# Answers a sidecar retries and a retry may change. UNAVAILABLE: the driver down or restarting;
# DEADLINE_EXCEEDED and CANCELLED: the call's time ran out; ABORTED: an operation on the volume is
# in progress (CSI's own word for "retry later").
RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
     grpc.StatusCode.CANCELLED}
)  # fmt: skip
DATA_FILE = "bench-data.bin"
DATA_BYTES = 256 * 1024


def prepare_paths(request: Message) -> None:
    """What the CO creates before a node call: the staging directory, the target's parent."""
    if isinstance(request, csi_pb2.NodeStageVolumeRequest):
        os.makedirs(request.staging_target_path, exist_ok=True)
    elif isinstance(request, csi_pb2.NodePublishVolumeRequest):
        os.makedirs(os.path.dirname(request.target_path), exist_ok=True)


class CallFailed(Exception):
    def __init__(self, step: str, code: str, details: str) -> None:
        super().__init__(f"{step} answered {code}: {details}")
        self.step, self.code, self.details = step, code, details


@dataclass(frozen=True)
class DataAction:
    """A file written or read back through a published target, between two calls."""

    kind: str  # "write" or "verify"
    path: str
    seed: str  # the content is derived from it, so a replay writes the same bytes
    after_call: int  # how many calls the proxy had seen when it ran

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "seed": self.seed, "after_call": self.after_call}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> DataAction:
        return DataAction(str(doc["kind"]), str(doc["path"]), str(doc["seed"]), int(doc["after_call"]))


def content(seed: str) -> bytes:
    return hashlib.shake_256(seed.encode()).digest(DATA_BYTES)


def run_data_action(action: DataAction) -> Finding | None:
    """Writes the file (flushed to the device: an application's part before a snapshot), or reads
    it back and compares."""
    path = os.path.join(action.path, DATA_FILE)
    expected = content(action.seed)
    try:
        if action.kind == "write":
            with open(path, "wb") as f:
                f.write(expected)
                f.flush()
                os.fsync(f.fileno())
            return None
        with open(path, "rb") as f:
            got = f.read()
    except OSError as e:
        return Finding("data-unavailable", f"{action.kind} of {path} failed: {e}")
    if got != expected:
        return Finding(
            "data-mismatch",
            f"{path} reads back {len(got)} bytes (sha256 {hashlib.sha256(got).hexdigest()[:12]}), "
            f"not the {len(expected)} written (sha256 {hashlib.sha256(expected).hexdigest()[:12]})",
        )
    return None


@dataclass(frozen=True)
class Capabilities:
    publish: bool
    stage: bool
    controller_expand: bool
    node_expand: bool
    snapshots: bool
    node_id: str


@dataclass(frozen=True)
class Settings:
    kubelet_dir: Path
    node_id: str
    size_bytes: int
    expand_to_bytes: int
    fs_type: str
    mount_options: list[str]  # the StorageClass's mountOptions, which kubelet sends as mount_flags
    parameters: dict[str, str]
    snapshot_parameters: dict[str, str]
    call_deadline: float = 60.0  # how long a call may keep failing retryably before it is a finding
    call_timeout: float = 30.0  # the caller's own deadline on each try, as a sidecar's --timeout


@dataclass
class Caller:
    """CSI calls through one endpoint (the proxy's), retried as a sidecar retries them."""

    channel: grpc.aio.Channel
    settings: Settings
    # Called after each data action with the action; the campaign records them for the reproducer.
    on_data: Callable[[DataAction], None] = lambda _: None
    findings: list[Finding] = field(default_factory=list)

    async def once(self, short: str, request: Message) -> Message:
        method = messages.method_of(short)
        stub = self.channel.unary_unary(
            method,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=lambda data: messages.decode(method, data, response=True),
        )
        answer: Message = await stub(request, timeout=self.settings.call_timeout)
        return answer

    async def call(self, short: str, request: Message, step: str = "") -> Any:
        """The call, retried until it succeeds or gives an answer no retry changes."""
        prepare_paths(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.call_deadline
        delay = 0.05
        while True:
            try:
                return await self.once(short, request)
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code not in RETRYABLE:
                    raise CallFailed(step or short, code.name, e.details() or "") from None
                if loop.time() + delay > deadline:
                    raise CallFailed(
                        step or short,
                        code.name,
                        f"still failing after {self.settings.call_deadline:g}s: {e.details()}",
                    ) from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    def mount_capability(self) -> csi_pb2.VolumeCapability:
        return csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(
                fs_type=self.settings.fs_type, mount_flags=self.settings.mount_options
            ),
            access_mode=csi_pb2.VolumeCapability.AccessMode(
                mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
            ),
        )

    async def capabilities(self) -> Capabilities:
        controller = await self.call("ControllerGetCapabilities", csi_pb2.ControllerGetCapabilitiesRequest())
        node = await self.call("NodeGetCapabilities", csi_pb2.NodeGetCapabilitiesRequest())
        info = await self.call("NodeGetInfo", csi_pb2.NodeGetInfoRequest())
        c = {cap.rpc.type for cap in controller.capabilities}
        n = {cap.rpc.type for cap in node.capabilities}
        rpc = csi_pb2.ControllerServiceCapability.RPC
        node_rpc = csi_pb2.NodeServiceCapability.RPC
        return Capabilities(
            publish=rpc.PUBLISH_UNPUBLISH_VOLUME in c,
            stage=node_rpc.STAGE_UNSTAGE_VOLUME in n,
            controller_expand=rpc.EXPAND_VOLUME in c,
            node_expand=node_rpc.EXPAND_VOLUME in n,
            snapshots=rpc.CREATE_DELETE_SNAPSHOT in c,
            node_id=info.node_id or self.settings.node_id,
        )

    def data(self, kind: str, path: str, seed: str, calls_so_far: int) -> None:
        action = DataAction(kind, path, seed, calls_so_far)
        self.on_data(action)
        finding = run_data_action(action)
        if finding is not None:
            self.findings.append(finding)


@dataclass
class Attachment:
    """A volume published, staged and node-published at one place."""

    volume_id: str
    staging: str
    target: str
    publish_context: dict[str, str]


class Lifecycle:
    """One volume's lifecycle, numbered so that names and paths never clash with the others'."""

    def __init__(
        self, caller: Caller, caps: Capabilities, prefix: str, index: int, calls: Callable[[], int]
    ) -> None:
        self.caller, self.caps, self.index = caller, caps, index
        self.name = f"{prefix}-{index}"
        self.calls = calls  # how many calls the proxy has seen: where a data action stands
        self.settings = caller.settings

    def paths(self, tag: str) -> tuple[str, str]:
        base = self.settings.kubelet_dir
        return str(base / "staging" / f"{tag}{self.index}"), str(
            base / "pods" / f"{tag}{self.index}" / "mount"
        )

    async def attach(self, volume_id: str, tag: str, context: dict[str, str]) -> Attachment:
        c, cap = self.caller, self.caller.mount_capability()
        staging, target = self.paths(tag)
        publish_context: dict[str, str] = {}
        if self.caps.publish:
            rsp = await c.call(
                "ControllerPublishVolume",
                csi_pb2.ControllerPublishVolumeRequest(
                    volume_id=volume_id,
                    node_id=self.caps.node_id,
                    volume_capability=cap,
                    volume_context=context,
                ),
            )
            publish_context = dict(rsp.publish_context)
        if self.caps.stage:
            await c.call(
                "NodeStageVolume",
                csi_pb2.NodeStageVolumeRequest(
                    volume_id=volume_id,
                    staging_target_path=staging,
                    volume_capability=cap,
                    publish_context=publish_context,
                    volume_context=context,
                ),
            )
            self.check_stacked(staging)
        await c.call(
            "NodePublishVolume",
            csi_pb2.NodePublishVolumeRequest(
                volume_id=volume_id,
                staging_target_path=staging if self.caps.stage else "",
                target_path=target,
                volume_capability=cap,
                publish_context=publish_context,
                volume_context=context,
            ),
        )
        self.check_stacked(target)
        return Attachment(volume_id, staging, target, publish_context)

    def check_stacked(self, path: str) -> None:
        finding = stacked_mounts(path)
        if finding is not None:
            self.caller.findings.append(finding)

    async def detach(self, a: Attachment) -> None:
        c = self.caller
        await c.call(
            "NodeUnpublishVolume",
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=a.volume_id, target_path=a.target),
        )
        if self.caps.stage:
            await c.call(
                "NodeUnstageVolume",
                csi_pb2.NodeUnstageVolumeRequest(volume_id=a.volume_id, staging_target_path=a.staging),
            )
        if self.caps.publish:
            await c.call(
                "ControllerUnpublishVolume",
                csi_pb2.ControllerUnpublishVolumeRequest(volume_id=a.volume_id, node_id=self.caps.node_id),
            )

    async def run(self) -> None:
        c, s = self.caller, self.settings
        cap = c.mount_capability()
        created = await c.call(
            "CreateVolume",
            csi_pb2.CreateVolumeRequest(
                name=self.name,
                capacity_range=csi_pb2.CapacityRange(required_bytes=s.size_bytes),
                volume_capabilities=[cap],
                parameters=s.parameters,
            ),
        )
        volume = created.volume
        context = dict(volume.volume_context)
        a = await self.attach(volume.volume_id, "v", context)
        c.data("write", a.target, self.name, self.calls())
        await self.expand(a)
        restored = await self.snapshot_and_restore(volume.volume_id, cap) if self.caps.snapshots else None
        await self.detach(a)
        if restored is not None:
            snapshot_id, restored_id = restored
            await c.call("DeleteSnapshot", csi_pb2.DeleteSnapshotRequest(snapshot_id=snapshot_id))
            await c.call("DeleteVolume", csi_pb2.DeleteVolumeRequest(volume_id=restored_id))
        await c.call("DeleteVolume", csi_pb2.DeleteVolumeRequest(volume_id=volume.volume_id))

    async def expand(self, a: Attachment) -> None:
        if not self.caps.controller_expand:
            return
        c, s = self.caller, self.settings
        rsp = await c.call(
            "ControllerExpandVolume",
            csi_pb2.ControllerExpandVolumeRequest(
                volume_id=a.volume_id,
                capacity_range=csi_pb2.CapacityRange(required_bytes=s.expand_to_bytes),
                volume_capability=c.mount_capability(),
            ),
        )
        if rsp.node_expansion_required and self.caps.node_expand:
            await c.call(
                "NodeExpandVolume",
                csi_pb2.NodeExpandVolumeRequest(
                    volume_id=a.volume_id,
                    volume_path=a.target,
                    staging_target_path=a.staging if self.caps.stage else "",
                    capacity_range=csi_pb2.CapacityRange(required_bytes=s.expand_to_bytes),
                    volume_capability=c.mount_capability(),
                ),
            )
        c.data("verify", a.target, self.name, self.calls())

    async def snapshot_and_restore(self, volume_id: str, cap: csi_pb2.VolumeCapability) -> tuple[str, str]:
        """The snapshot and the volume restored from it (its data checked); both are deleted by
        `run` after the source is detached, in the issue's order."""
        c, s = self.caller, self.settings
        request = csi_pb2.CreateSnapshotRequest(
            source_volume_id=volume_id, name=f"{self.name}-snap", parameters=s.snapshot_parameters
        )
        # csi-snapshotter calls CreateSnapshot again, with the same request, until ready_to_use.
        snapshot = (await c.call("CreateSnapshot", request)).snapshot
        while not snapshot.ready_to_use:
            await asyncio.sleep(0.1)
            snapshot = (await c.call("CreateSnapshot", request)).snapshot
        restored = await c.call(
            "CreateVolume",
            csi_pb2.CreateVolumeRequest(
                name=f"{self.name}-restore",
                capacity_range=csi_pb2.CapacityRange(
                    required_bytes=max(s.expand_to_bytes, snapshot.size_bytes)
                ),
                volume_capabilities=[cap],
                parameters=s.parameters,
                volume_content_source=csi_pb2.VolumeContentSource(
                    snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snapshot.snapshot_id)
                ),
            ),
            step="CreateVolumeFromSnapshot",
        )
        r = restored.volume
        a = await self.attach(r.volume_id, "r", dict(r.volume_context))
        c.data("verify", a.target, self.name, self.calls())
        await self.detach(a)
        return snapshot.snapshot_id, r.volume_id
