"""A failed CreateVolume's state, decided where the call returns (volume_calls), and what the
provisioning controller does with it: the intent journal keeps a request the driver may still be
running (or whose volume exists), an infeasible one slows the claim's retries down with upstream's
text, and a RESOURCE_EXHAUSTED is a reschedule only for a request that named the selected node."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from controller_runtime.client import ApiClient
from controller_runtime.controller import ControllerContext
from controller_runtime.csi_client import CSIConnection
from controller_runtime.csi_errors import OperationState
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.kinds import PersistentVolumeClaim, StorageClass
from external_provisioner.clone_protection import CloneProtectionController
from external_provisioner.journal import Entry, Journal, read
from external_provisioner.options import Options
from external_provisioner.provisioning import ProvisioningController
from external_provisioner.request import ProvisionError, VolumeSpec
from external_provisioner.snapshot_protection import SnapshotProtectionController
from external_provisioner.volume_calls import VolumeCalls

Code = grpc.StatusCode
SPEC = VolumeSpec("pvc-u-1", 1 << 30, False, "ext4", [], ["ReadWriteOnce"], {})
CLASS: StorageClass = {"metadata": {"name": "fast", "uid": "class-1"}}
CLAIM: PersistentVolumeClaim = {"metadata": {"name": "data", "namespace": "ns", "uid": "u-1"}}


class Refusing:
    """A controller service whose CreateVolume fails with `code`."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code

    async def CreateVolume(self, _req: Any, timeout: float) -> Any:
        raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="no")


class Connection(CSIConnection):
    fake: Refusing

    @property
    def controller(self) -> Any:
        return self.fake


def connection(code: grpc.StatusCode) -> Connection:
    conn = Connection(address="unix:///x", timeout=1.0, channel=cast(Any, None), driver_name="d")
    conn.fake = Refusing(code)
    return conn


@pytest.mark.parametrize(
    ("code", "may_reschedule", "state"),
    [
        (Code.DEADLINE_EXCEEDED, True, OperationState.IN_BACKGROUND),
        (Code.ALREADY_EXISTS, False, OperationState.IN_BACKGROUND),
        (Code.RESOURCE_EXHAUSTED, True, OperationState.RESCHEDULE),
        (Code.RESOURCE_EXHAUSTED, False, OperationState.FINISHED),
        (Code.INVALID_ARGUMENT, True, OperationState.INFEASIBLE),
        (Code.INTERNAL, True, OperationState.FINISHED),
    ],
)
def test_create_volume_classifies_its_failure_where_it_returns(
    code: grpc.StatusCode, may_reschedule: bool, state: OperationState
) -> None:
    calls = VolumeCalls(cast(ApiClient, None), connection(code))
    with pytest.raises(ProvisionError) as err:
        asyncio.run(calls.create_volume(SPEC, {}, may_reschedule=may_reschedule))
    assert err.value.state is state
    assert err.value.reschedule == (state is OperationState.RESCHEDULE)
    assert str(err.value).startswith("rpc error: code = ") and str(err.value).endswith(" desc = no")


@pytest.mark.parametrize(
    ("code", "kept", "text"),
    [
        (Code.DEADLINE_EXCEEDED, True, "rpc error: code = DeadlineExceeded desc = no"),
        (Code.ALREADY_EXISTS, True, "rpc error: code = AlreadyExists desc = no"),
        (Code.INTERNAL, False, "rpc error: code = Internal desc = no"),
        (
            Code.INVALID_ARGUMENT,
            False,
            "Volume provisioning failed with infeasible error. Retries will be delayed. "
            "rpc error: code = InvalidArgument desc = no",
        ),
    ],
)
def test_the_journal_and_the_slow_retries_follow_the_state(
    tmp_path: Path, code: grpc.StatusCode, kept: bool, text: str
) -> None:
    async def main() -> None:
        client = cast(ApiClient, None)
        context = ControllerContext(client, SharedInformerFactory(client), cast(EventRecorder, None))
        conn, options = connection(code), Options(identity="i")
        journal = Journal(tmp_path)
        prov = ProvisioningController(
            context,
            conn,
            journal,
            options,
            CloneProtectionController(context, conn, options),
            SnapshotProtectionController(context, conn, options),
        )
        entry = Entry("u-1", "ns", "data", "fast", SPEC)
        await journal.put(entry)
        with pytest.raises(ProvisionError) as err:
            await prov._create_volume(CLAIM, CLASS, entry, {}, may_reschedule=True)
        assert str(err.value) == text
        assert (journal.get("u-1") is not None) == kept
        assert ("u-1" in read(tmp_path)) == kept  # and on disk the same
        delayed = prov.infeasible.remaining("u-1", "class-1", prov.clock.monotonic()) > 0
        assert delayed == (code is Code.INVALID_ARGUMENT)

    asyncio.run(main())
