"""The capability the external-attacher and -resizer send for a PV: csi-lib-utils' ToCSIAccessMode
for the PV's whole list of modes, errors included (issue 29: kubeloop mapped any list to its
widest mode, so ReadOnlyMany with ReadWriteOnce was published read-only)."""

from __future__ import annotations

import pytest

from controller_runtime.kinds import PersistentVolume
from controller_runtime.volumes import csi_volume, pv_access_mode, pv_capability
from kubeloop_grpc.csi import csi_pb2

Mode = csi_pb2.VolumeCapability.AccessMode.Mode
RWO, ROX, RWX, RWOP = "ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"


@pytest.mark.parametrize(
    ("modes", "plain", "multi_writer"),
    [
        ([RWO], Mode.SINGLE_NODE_WRITER, Mode.SINGLE_NODE_MULTI_WRITER),
        ([RWOP], Mode.SINGLE_NODE_WRITER, Mode.SINGLE_NODE_SINGLE_WRITER),
        ([ROX], Mode.MULTI_NODE_READER_ONLY, Mode.MULTI_NODE_READER_ONLY),
        ([RWX], Mode.MULTI_NODE_MULTI_WRITER, Mode.MULTI_NODE_MULTI_WRITER),
        ([RWO, RWX, ROX], Mode.MULTI_NODE_MULTI_WRITER, Mode.MULTI_NODE_MULTI_WRITER),  # RWX wins
        ([RWO, RWO], Mode.SINGLE_NODE_WRITER, Mode.SINGLE_NODE_MULTI_WRITER),
    ],
)
def test_modes_map_as_csi_lib_utils(modes: list[str], plain: int, multi_writer: int) -> None:
    assert pv_access_mode(modes, False) == plain
    assert pv_access_mode(modes, True) == multi_writer


@pytest.mark.parametrize(
    ("modes", "message"),
    [
        ([RWO, ROX], "CSI does not support ReadOnlyMany and ReadWriteOnce on the same PersistentVolume"),
        (
            [RWOP, RWO],
            "Kubernetes does not support use of ReadWriteOncePod with other access modes on the same "
            "PersistentVolume",
        ),
        ([], "unsupported AccessMode combination: []"),
        (["Sometimes"], "unsupported AccessMode combination: [Sometimes]"),
    ],
)
def test_lists_csi_cannot_express_are_refused(modes: list[str], message: str) -> None:
    for multi_writer in (False, True):
        with pytest.raises(ValueError) as err:
            pv_access_mode(modes, multi_writer)
        assert str(err.value) == message


def test_capability_is_block_or_mount_with_the_pv_fs_type_and_options() -> None:
    pv: PersistentVolume = {
        "metadata": {"name": "pv"},
        "spec": {
            "accessModes": [RWO],
            "mountOptions": ["noatime"],
            "csi": {"driver": "d", "volumeHandle": "h", "fsType": "xfs"},
        },
    }
    vol = csi_volume(pv)
    assert vol is not None
    cap = pv_capability(vol, True)
    assert cap.access_mode.mode == Mode.SINGLE_NODE_MULTI_WRITER
    assert cap.mount.fs_type == "xfs" and list(cap.mount.mount_flags) == ["noatime"]
    block = csi_volume({**pv, "spec": {**pv["spec"], "volumeMode": "Block"}})
    assert block is not None and pv_capability(block, False).HasField("block")
