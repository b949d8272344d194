"""The external-resizer against the real apiserver and the real CSI driver (`--mode controller`, a
subprocess on a temporary pool), in-process, with the ControllerExpandVolume requests recorded on
their way to the driver: what reaches the driver from a claim and its PV (issue 29). A claim's
author can name any resizer in its storage-resizer annotation; the PV's controllerExpandSecretRef,
access modes and fsType are what ControllerExpandVolume is built from. The claims are made Bound
by the test, as the pv-controller would (kcm's binder is off in the test control plane)."""

from __future__ import annotations

import base64

import pytest

from controller_runtime.resize_status import RESIZER_ANNOTATION
from controller_runtime.resources import PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, SECRETS
from csi_driver import DRIVER_NAME
from tests.support.waits import consistently_async, eventually_async, no_problems

from .resizer_setup import MiB, Mode, Setup, setup

pytestmark = pytest.mark.integration
__all__ = ["setup"]  # the fixture


async def test_a_claim_naming_this_resizer_is_not_enough(setup: Setup) -> None:
    """The storage-resizer annotation counts upstream only for a driver that in-tree volumes
    migrate to. kubeloop's resizer took any claim annotated with its driver's name: it marked a
    claim of another driver's volume as resizing and asked its own driver to expand that
    driver's handle, and crashed its sync on a claim of a non-CSI volume (after marking it)."""
    s, api = setup, setup.api
    csi = await s.start_resizer()
    mine = {RESIZER_ANNOTATION: DRIVER_NAME}
    foreign = {"csi": {"driver": "other.csi.example.com", "volumeHandle": "theirs"}}
    other_pv = await s.bound_claim("other", foreign, annotations=mine)
    local_pv = await s.bound_claim("local", {"hostPath": {"path": "/tmp/kubeloop-nowhere"}}, annotations=mine)
    bound = {"phase": "Bound", "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "16Mi"}}

    async def untouched() -> list[str]:
        problems = [f"ControllerExpandVolume {csi.expands}"] if csi.expands else []
        for claim, pv in (("other", other_pv), ("local", local_pv)):
            status = (await api.get(PERSISTENT_VOLUME_CLAIMS, claim, s.ns))["status"]
            capacity = (await api.get(PERSISTENT_VOLUMES, pv))["spec"]["capacity"]
            events = await s.events(claim)
            problems += [f"{claim}: status {status}"] if status != bound else []
            problems += [f"{pv}: capacity {capacity}"] if capacity != {"storage": "16Mi"} else []
            problems += [f"{claim}: events {events}"] if events else []
        return problems

    # Several syncs and retries' worth.
    await consistently_async(
        "the claims of other volumes untouched", untouched, 3, 0.2, satisfied=no_problems
    )


async def test_expand_request_carries_the_pv_secret_and_its_access_mode(setup: Setup) -> None:
    """ControllerExpandVolume as csi-resizer sends it: with the PV's controllerExpandSecretRef
    (a Secret that cannot be read fails the attempt, before the driver is asked), and with the
    access mode from csi-lib-utils' mapping of the PV's modes (SINGLE_NODE_MULTI_WRITER for RWO on
    a driver that has it; ReadOnlyMany with ReadWriteOnce refused). kubeloop sent no secrets,
    always SINGLE_NODE_WRITER, and ReadOnlyMany for the pair."""
    s, api = setup, setup.api
    csi = await s.start_resizer()
    handle = await s.volume(csi, "grow")
    ref = {"name": "expand", "namespace": s.ns}
    pv = await s.bound_claim(
        "grow",
        {
            "csi": {
                "driver": DRIVER_NAME,
                "volumeHandle": handle,
                "fsType": "ext4",
                "controllerExpandSecretRef": ref,
            }
        },
    )
    want = f'resize volume "{pv}" by resizer "{DRIVER_NAME}" failed: '

    async def failed(claim: str, text: str) -> bool:
        return bool(("VolumeResizeFailed", want + text) in await s.events(claim))

    await eventually_async(
        "VolumeResizeFailed for the missing Secret",
        lambda: failed(
            "grow", f'error getting secret expand in namespace {s.ns}: secrets "expand" not found'
        ),
        20,
    )
    assert csi.expands == [], "the driver was asked without the Secret"

    await api.create(
        SECRETS, {"metadata": {"name": "expand"}, "data": {"key": base64.b64encode(b"v").decode()}}, s.ns
    )

    async def grown() -> bool:
        return bool((await api.get(PERSISTENT_VOLUMES, pv))["spec"]["capacity"] == {"storage": "32Mi"})

    await eventually_async("the PV grown to 32Mi", grown, 20)
    req = csi.expands[-1]
    assert req.volume_id == handle and req.capacity_range.required_bytes == 32 * MiB
    assert dict(req.secrets) == {"key": "v"}
    assert req.volume_capability.access_mode.mode == Mode.SINGLE_NODE_MULTI_WRITER
    assert req.volume_capability.mount.fs_type == "ext4"

    both = await s.volume(csi, "both")
    pv = await s.bound_claim(
        "both",
        {"csi": {"driver": DRIVER_NAME, "volumeHandle": both}},
        modes=("ReadWriteOnce", "ReadOnlyMany"),
    )
    want = f'resize volume "{pv}" by resizer "{DRIVER_NAME}" failed: '
    await eventually_async(
        "VolumeResizeFailed for ReadOnlyMany with ReadWriteOnce",
        lambda: failed(
            "both",
            f"failed to get capabilities of volume {pv} with "
            "CSI does not support ReadOnlyMany and ReadWriteOnce on the same PersistentVolume",
        ),
        20,
    )
    assert [r.volume_id for r in csi.expands].count(both) == 0
