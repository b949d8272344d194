"""The provisioner's calls to the CSI driver, CreateVolume and DeleteVolume, and the provisioner
Secret each is sent with: what the provisioning and the deletion controllers share. A failed call
is a ProvisionError whose state (controller_runtime.csi_errors) is decided here, where the call
returns, and nowhere else."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import grpc

from controller_runtime.client import ApiClient
from controller_runtime.csi_client import CSIConnection, error_text
from controller_runtime.csi_errors import CREATE_VOLUME, DELETE_VOLUME, Rpc, classify
from controller_runtime.logs import get_logger
from controller_runtime.secrets import SecretNotSendable, SecretUnavailable, read_csi_secrets
from kubeloop_grpc.csi import csi_pb2

from .request import CreatedVolume, ProvisionError, SecretRef, VolumeSpec

log = get_logger("external-provisioner")


# A copy made by a node-deployment provisioner: its source was found in the API before the request
# was sent, so the node's driver answering NOT_FOUND says that this node's pool lacks it (a
# node-local pool holds its own node's volumes only, and the scheduler does not know where a source
# lives); another node's may hold it, as for RESOURCE_EXHAUSTED. Upstream reads NOT_FOUND as final,
# which kept a claim scheduled to the wrong node there for good. A kubeloop extension.
CREATE_COPY_ON_NODE = replace(
    CREATE_VOLUME, node_bound=CREATE_VOLUME.node_bound | {grpc.StatusCode.NOT_FOUND}
)


def _failed(rpc: Rpc, exc: grpc.aio.AioRpcError, *, may_reschedule: bool = False) -> ProvisionError:
    return ProvisionError(error_text(exc), classify(rpc, exc.code(), may_reschedule=may_reschedule))


class VolumeCalls:
    def __init__(self, client: ApiClient, csi: CSIConnection) -> None:
        self.client = client
        self.csi = csi

    async def secrets(self, ref: SecretRef | None, *, required: bool = True) -> dict[str, str]:
        """The Secret's data for a CSI request. One that cannot be read stops only a provisioning
        (`required`: DeleteVolume goes without it, as upstream); one that can be read but not sent
        (data that is not UTF-8) stops either, with the error the Go sidecar's request fails with."""
        if ref is None:
            return {}
        try:
            return await read_csi_secrets(self.client, ref.name, ref.namespace)
        except SecretUnavailable as exc:
            if not required:
                log.warning("deleting without the provisioner secret", error=str(exc))
                return {}
            raise ProvisionError(str(exc)) from exc
        except SecretNotSendable as exc:
            raise ProvisionError(str(exc)) from exc

    async def create_volume(
        self,
        spec: VolumeSpec,
        secrets: Mapping[str, str],
        *,
        may_reschedule: bool = False,
        node_deployment: bool = False,
    ) -> CreatedVolume:
        """`may_reschedule`: the request named the selected node's topology, so a driver out of room
        there (RESOURCE_EXHAUSTED) may find it on another node; in `node_deployment`, so may a copy
        whose source this node's driver does not hold (NOT_FOUND)."""
        copy = spec.source_volume or spec.source_snapshot
        rpc = CREATE_COPY_ON_NODE if node_deployment and copy else CREATE_VOLUME
        try:
            rsp = await self.csi.controller.CreateVolume(spec.to_request(secrets), timeout=self.csi.timeout)
        except grpc.aio.AioRpcError as exc:
            raise _failed(rpc, exc, may_reschedule=may_reschedule) from exc
        return CreatedVolume.from_proto(rsp.volume)

    async def delete_volume(self, volume_id: str, secrets: Mapping[str, str]) -> None:
        request = csi_pb2.DeleteVolumeRequest(volume_id=volume_id, secrets=dict(secrets))
        try:
            await self.csi.controller.DeleteVolume(request, timeout=self.csi.timeout)
        except grpc.aio.AioRpcError as exc:
            raise _failed(DELETE_VOLUME, exc) from exc
