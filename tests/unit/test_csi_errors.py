"""The one classification of failed CSI calls (controller_runtime.csi_errors) against the Go
sidecars' tables: external-provisioner's checkError and the provisioning library's
isInfeasibleError, external-attacher's isFinalError, external-resizer's IsFinalError and
IsInfeasibleError."""

from __future__ import annotations

import grpc
import pytest

from controller_runtime.csi_errors import (
    CREATE_VOLUME,
    DELETE_VOLUME,
    EXPAND_VOLUME,
    IN_PROGRESS_CODES,
    PUBLISH_VOLUME,
    OperationState,
    Rpc,
    classify,
    status_code,
)
from controller_runtime.secrets import SecretNotSendable

Code = grpc.StatusCode
State = OperationState
FAILURES = [c for c in Code if c is not Code.OK]
TRANSPORT = {Code.CANCELLED, Code.DEADLINE_EXCEEDED, Code.UNAVAILABLE, Code.ABORTED}


def test_the_in_progress_codes_are_grpc_and_csi_pending_ones() -> None:
    assert IN_PROGRESS_CODES == TRANSPORT


@pytest.mark.parametrize("code", FAILURES, ids=lambda c: c.name)
def test_create_volume_as_check_error(code: grpc.StatusCode) -> None:
    expected = State.FINISHED
    if code in TRANSPORT or code is Code.ALREADY_EXISTS:  # kubeloop keeps the intent of an existing volume
        expected = State.IN_BACKGROUND
    elif code is Code.INVALID_ARGUMENT:
        expected = State.INFEASIBLE
    assert classify(CREATE_VOLUME, code) is expected
    rescheduled = State.RESCHEDULE if code is Code.RESOURCE_EXHAUSTED else expected
    assert classify(CREATE_VOLUME, code, may_reschedule=True) is rescheduled


@pytest.mark.parametrize("code", FAILURES, ids=lambda c: c.name)
def test_publish_and_delete_volume_only_tell_final_from_in_progress(code: grpc.StatusCode) -> None:
    busy = TRANSPORT | {Code.RESOURCE_EXHAUSTED}  # the attacher's isFinalError: a busy server too
    assert classify(PUBLISH_VOLUME, code) is (State.IN_BACKGROUND if code in busy else State.FINISHED)
    assert classify(DELETE_VOLUME, code) is (State.IN_BACKGROUND if code in TRANSPORT else State.FINISHED)
    # Neither has a node to give back nor an infeasible kind: may_reschedule changes nothing.
    assert classify(PUBLISH_VOLUME, code, may_reschedule=True) is classify(PUBLISH_VOLUME, code)
    assert classify(DELETE_VOLUME, code, may_reschedule=True) is classify(DELETE_VOLUME, code)


@pytest.mark.parametrize("code", FAILURES, ids=lambda c: c.name)
def test_expand_volume_as_the_resizer(code: grpc.StatusCode) -> None:
    expected = State.FINISHED
    if code in TRANSPORT | {Code.RESOURCE_EXHAUSTED}:
        expected = State.IN_BACKGROUND
    elif code in (Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE, Code.NOT_FOUND):
        expected = State.INFEASIBLE
    assert classify(EXPAND_VOLUME, code) is expected


@pytest.mark.parametrize("rpc", [CREATE_VOLUME, DELETE_VOLUME, PUBLISH_VOLUME, EXPAND_VOLUME])
def test_a_failure_without_a_status_may_still_be_running(rpc: Rpc) -> None:
    assert classify(rpc, None) is State.IN_BACKGROUND
    assert classify(rpc, None, may_reschedule=True) is State.IN_BACKGROUND


def test_only_in_background_is_not_final() -> None:
    assert [s for s in State if not s.final] == [State.IN_BACKGROUND]


def test_status_code_of_a_failed_call() -> None:
    assert status_code(SecretNotSendable("x")) is Code.INTERNAL  # grpc-go's marshalling failure
    assert status_code(RuntimeError("before the call")) is None
    assert status_code(TimeoutError()) is None
