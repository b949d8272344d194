"""A copy's volume mode (issue 44): external-provisioner v6.3.0's --prevent-volume-mode-conversion
(KEP-3141) for restores, and its unconditional check for clones. The texts are upstream's
getSnapshotSource and getPVCSource errors, which the ProvisioningFailed event carries."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.goflags import parse_bool
from controller_runtime.kinds import (
    PersistentVolume,
    PersistentVolumeClaim,
    StorageClass,
    VolumeSnapshotContent,
    as_obj,
    pv_view,
    pvc_view,
    snapshot_content_view,
)
from controller_runtime.resources import VOLUME_SNAPSHOT_CONTENTS, VOLUME_SNAPSHOTS, Obj
from controller_runtime.store import Store
from external_provisioner.content_source import Content, ContentSources
from external_provisioner.decide import (
    DataSource,
    clone_mode_error,
    mode_change_granted,
    restore_mode_error,
)
from external_provisioner.main import build_parser, controller_options
from external_provisioner.request import ProvisionError, split_parameters, volume_spec

KEY = "snapshot.storage.kubernetes.io/allow-volume-mode-change"
REFUSED = (
    "requested volume ns/data modifies the mode of the source volume but does not have permission to do so. "
)
SNAPSHOT = DataSource("VolumeSnapshot", "snap", "ns", "snapshot.storage.k8s.io")
CLASS: StorageClass = {"metadata": {"name": "kubeloop"}, "provisioner": "loop.csi.kubeloop.dev"}


def claim(mode: str | None = "Block") -> PersistentVolumeClaim:
    spec: Obj = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    if mode is not None:
        spec["volumeMode"] = mode
    return pvc_view({"metadata": {"name": "data", "namespace": "ns", "uid": "u-data"}, "spec": spec})


def content(source_mode: str | None = "Filesystem", allow: str | None = None) -> VolumeSnapshotContent:
    spec: Obj = {
        "driver": "loop.csi.kubeloop.dev",
        "volumeSnapshotRef": {"name": "snap", "namespace": "ns", "uid": "u-snap"},
    }
    if source_mode is not None:
        spec["sourceVolumeMode"] = source_mode
    annotations = {} if allow is None else {KEY: allow}
    return snapshot_content_view(
        {
            "metadata": {"name": "snapcontent-1", "annotations": annotations},
            "spec": spec,
            "status": {"snapshotHandle": "snap-handle"},
        }
    )


def source_pv(mode: str | None) -> PersistentVolume:
    return pv_view({"spec": {} if mode is None else {"volumeMode": mode}})


# -- restores: --prevent-volume-mode-conversion ----------------------------------------------------


@pytest.mark.parametrize(
    ("allow", "reason"),
    [
        (None, f"{KEY} annotation is not present on snapshotcontent snapcontent-1"),
        ("false", f"{KEY} is set to false on snapshotcontent snapcontent-1"),
        ("0", f"{KEY} is set to false on snapshotcontent snapcontent-1"),
        (
            "yes",
            f"failed to convert {KEY} annotation value to boolean with error: "
            'strconv.ParseBool: parsing "yes": invalid syntax',
        ),
        (
            "",
            f"failed to convert {KEY} annotation value to boolean with error: "
            'strconv.ParseBool: parsing "": invalid syntax',
        ),
    ],
)
@pytest.mark.parametrize(("claim_mode", "source_mode"), [("Block", "Filesystem"), ("Filesystem", "Block")])
def test_a_restore_in_another_mode_is_refused_without_the_grant(
    allow: str | None, reason: str, claim_mode: str, source_mode: str
) -> None:
    """Either direction; the three texts of upstream's getSnapshotSource."""
    assert (
        restore_mode_error(claim(claim_mode), content(source_mode, allow), prevent=True) == REFUSED + reason
    )


@pytest.mark.parametrize("allow", ["true", "True", "TRUE", "t", "T", "1"])
def test_the_annotation_allows_a_mode_change(allow: str) -> None:
    """Any spelling Go's strconv.ParseBool reads as true."""
    assert restore_mode_error(claim("Block"), content("Filesystem", allow), prevent=True) is None
    assert mode_change_granted(content("Filesystem", allow))


@pytest.mark.parametrize("allow", [None, "false", "yes", "tRuE"])
def test_no_grant_without_a_true_annotation(allow: str | None) -> None:
    assert not mode_change_granted(content("Filesystem", allow))


def test_the_flag_off_lets_every_mode_change_through() -> None:
    assert restore_mode_error(claim("Block"), content("Filesystem"), prevent=False) is None


@pytest.mark.parametrize(
    ("claim_mode", "source_mode"),
    [
        ("Block", "Block"),
        ("Filesystem", "Filesystem"),
        # Upstream compares only when both are set: a content without sourceVolumeMode (a
        # pre-provisioned one, or made by a snapshot-controller with the flag off) passes, and so
        # does a claim without a mode (never stored by the apiserver, which defaults it).
        ("Block", None),
        ("Filesystem", None),
        (None, "Block"),
    ],
)
def test_modes_that_are_the_same_or_unknown_pass(claim_mode: str | None, source_mode: str | None) -> None:
    assert restore_mode_error(claim(claim_mode), content(source_mode), prevent=True) is None


def test_parse_bool() -> None:
    assert [parse_bool(v) for v in ("1", "t", "T", "TRUE", "true", "True")] == [True] * 6
    assert [parse_bool(v) for v in ("0", "f", "F", "FALSE", "false", "False")] == [False] * 6
    with pytest.raises(ValueError, match=r'^strconv.ParseBool: parsing "on": invalid syntax$'):
        parse_bool("on")


# -- clones: always the source's mode --------------------------------------------------------------

CLONE_MODES = "the source PVC and destination PVCs must have the same volume mode for cloning.  "


@pytest.mark.parametrize(
    ("claim_mode", "pv_mode", "expected"),
    [
        ("Block", "Filesystem", CLONE_MODES + "Source is Filesystem, but new PVC requested Block"),
        ("Block", None, CLONE_MODES + "Source is Filesystem, but new PVC requested Block"),
        ("Filesystem", "Block", CLONE_MODES + "Source is Block, but new PVC requested Filesystem"),
        (None, "Block", CLONE_MODES + "Source is Block, but new PVC requested Filesystem"),
        ("Block", "Block", None),
        ("Filesystem", "Filesystem", None),
        ("Filesystem", None, None),
        (None, None, None),
    ],
)
def test_a_clone_keeps_its_source_mode(
    claim_mode: str | None, pv_mode: str | None, expected: str | None
) -> None:
    """getPVCSource's check, whatever --prevent-volume-mode-conversion says: no annotation on a
    claim or volume lifts it."""
    assert clone_mode_error(claim(claim_mode), source_pv(pv_mode)) == expected


# -- the flag --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "prevent"),
    [
        ([], True),
        (["--prevent-volume-mode-conversion"], True),
        (["--prevent-volume-mode-conversion=false"], False),
        (["--prevent-volume-mode-conversion=0"], False),
    ],
)
def test_the_flag_is_upstreams_and_on_by_default(argv: list[str], prevent: bool) -> None:
    args = build_parser().parse_args(argv)
    assert controller_options(args, "loop.csi.kubeloop.dev", None).prevent_mode_conversion is prevent


# -- where it runs: the restore's source, and the request ------------------------------------------


class Api:
    """The two objects a restore's source is read from."""

    def __init__(self, snapcontent: Obj) -> None:
        self.objects = {
            (VOLUME_SNAPSHOTS.plural, "snap"): {
                "metadata": {"name": "snap", "namespace": "ns", "uid": "u-snap"},
                "status": {
                    "boundVolumeSnapshotContentName": "snapcontent-1",
                    "readyToUse": True,
                    "restoreSize": "1Gi",
                },
            },
            (VOLUME_SNAPSHOT_CONTENTS.plural, "snapcontent-1"): snapcontent,
        }

    async def get(self, resource: Any, name: str, namespace: str | None = None) -> Obj:
        found = self.objects.get((resource.plural, name))
        if found is None:
            raise ApiError(404, {"message": f"{name} not found"})
        return found


def restore(snapcontent: VolumeSnapshotContent, mode: str, prevent: bool = True) -> Content:
    sources = ContentSources(cast(ApiClient, Api(as_obj(snapcontent))), cast(Store, None), prevent)
    return asyncio.run(sources.content(claim(mode), CLASS, SNAPSHOT))


def test_the_event_text_of_a_refused_restore() -> None:
    """The ProvisioningFailed event's whole text, as the Go sidecar words it."""
    with pytest.raises(ProvisionError) as err:
        restore(content("Filesystem"), "Block")
    assert str(err.value) == (
        "error getting handle for DataSource Type VolumeSnapshot by Name snap: "
        "requested volume ns/data modifies the mode of the source volume but does not have permission "
        "to do so. snapshot.storage.kubernetes.io/allow-volume-mode-change annotation is not present "
        "on snapshotcontent snapcontent-1"
    )
    assert not err.value.reschedule


def test_a_restore_carries_the_grant_to_the_driver() -> None:
    """A granted content's restore names it in CreateVolume's parameters (kubeloop's extension, for
    the driver's own check); without the grant, or with the flag off, nothing is added."""
    granted = restore(content("Filesystem", "true"), "Block")
    assert granted == Content(snapshot="snap-handle", mode_change_granted=True)
    assert restore(content("Filesystem"), "Filesystem") == Content(snapshot="snap-handle")
    assert restore(content("Filesystem"), "Block", prevent=False) == Content(snapshot="snap-handle")
    c = claim("Block")
    params = split_parameters({"kind": "fast"}, c, "pvc-u-data", "")

    def parameters(grant: bool) -> dict[str, str]:
        spec = volume_spec(
            c,
            CLASS,
            params,
            "pvc-u-data",
            extra_metadata=False,
            multi_writer=True,
            topology=None,
            source_snapshot="snap-handle",
            mode_change_granted=grant,
        )
        return dict(spec.to_request().parameters)

    assert parameters(True) == {"kind": "fast", KEY: "true"}
    assert parameters(False) == {"kind": "fast"}
