"""Where the node agent keeps volumes on disk (kubelet's layout) and how it reads them back.

Under the node's root directory (its /var/lib/kubelet):

    plugins/kubernetes.io/csi/<driver>/<sha256(handle)>/globalmount    staging path
    plugins/kubernetes.io/csi/<driver>/<sha256(handle)>/vol_data.json
    pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount                     filesystem volume
    pods/<uid>/volumes/kubernetes.io~csi/<pv>/vol_data.json
    pods/<uid>/volumeDevices/kubernetes.io~csi/<pv>/dev                 block volume (device file)
    pods/<uid>/volumeDevices/kubernetes.io~csi/<pv>/vol_data.json

vol_data.json is written *before* the CSI call it describes and removed after its inverse
succeeded, so after a crash every volume the driver may hold is on disk and can be unpublished
or unstaged; it is the agent's memory across restarts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from controller_runtime.files import write_atomic

VOL_DATA = "vol_data.json"
CSI_DIR = "kubernetes.io~csi"


@dataclass(frozen=True)
class VolData:
    specVolID: str
    volumeHandle: str
    driverName: str
    nodeName: str
    attachmentID: str = ""
    volumeLifecycleMode: str = "Persistent"
    volumeMode: str = "Filesystem"
    podUID: str = ""

    @property
    def block(self) -> bool:
        return self.volumeMode == "Block"


@dataclass(frozen=True)
class Layout:
    root: Path

    def staging_dir(self, driver: str, handle: str) -> Path:
        digest = hashlib.sha256(handle.encode()).hexdigest()
        return self.root / "plugins" / "kubernetes.io" / "csi" / driver / digest

    def staging_path(self, driver: str, handle: str) -> Path:
        return self.staging_dir(driver, handle) / "globalmount"

    def pod_volume_dir(self, pod_uid: str, pv_name: str, block: bool) -> Path:
        kind = "volumeDevices" if block else "volumes"
        return self.root / "pods" / pod_uid / kind / CSI_DIR / pv_name

    def target_path(self, pod_uid: str, pv_name: str, block: bool) -> Path:
        return self.pod_volume_dir(pod_uid, pv_name, block) / ("dev" if block else "mount")

    def plugins_registry(self) -> Path:
        return self.root / "plugins_registry"

    # -- reading back ---------------------------------------------------------------------------

    def staged(self) -> dict[tuple[str, str], VolData]:
        """(driver, handle) -> vol_data of every staging the agent began."""
        out = {}
        for path in (self.root / "plugins" / "kubernetes.io" / "csi").glob(f"*/*/{VOL_DATA}"):
            data = read_vol_data(path)
            if data is not None:
                out[(data.driverName, data.volumeHandle)] = data
        return out

    def published(self) -> dict[tuple[str, str], VolData]:
        """(pod uid, pv name) -> vol_data of every publish the agent began."""
        out = {}
        for kind in ("volumes", "volumeDevices"):
            for path in (self.root / "pods").glob(f"*/{kind}/{CSI_DIR}/*/{VOL_DATA}"):
                data = read_vol_data(path)
                if data is not None:
                    uid = path.parents[3].name
                    out[(uid, data.specVolID)] = data
        return out

    def pod_dirs(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            return [p.name for p in (self.root / "pods").iterdir() if p.is_dir()]
        return []


def read_vol_data(path: Path) -> VolData | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # a torn write: the CSI call it announced never ran
    try:
        return VolData(**{k: str(v) for k, v in raw.items() if k in VolData.__dataclass_fields__})
    except TypeError:
        return None


def write_vol_data(path: Path, data: VolData) -> None:
    """Atomic: a crash leaves the old file or the new one. Not fsync'd, as kubelet does not: the
    file tells a restarted agent which CSI calls to undo, and after a power loss there are no
    mounts or loop devices left to undo (a file lost with them is read as "nothing began")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(asdict(data)).encode(), mode=0o644, durable=False)


def remove_volume_dir(path: Path, leaf: str, stop: Path) -> None:
    """After a successful unpublish/unstage: removes the empty `leaf` (mount dir or device file),
    vol_data.json, then `path` and its empty parents up to (not including) `stop`. Never
    recursive: a directory with anything left in it (live data) stays."""
    target = path / leaf
    with contextlib.suppress(FileNotFoundError, OSError):
        if target.is_dir() and not target.is_symlink():
            target.rmdir()
        elif target.exists() and target.stat().st_size == 0:
            target.unlink()
    with contextlib.suppress(FileNotFoundError):
        (path / VOL_DATA).unlink()
    current = path
    while current != stop and stop in current.parents:
        try:
            current.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            return
        current = current.parent


def remove_pod_dir(path: Path) -> None:
    """Removes a pod's directory tree bottom-up if it only holds empty directories."""
    if not path.is_dir():
        return
    for dirpath, _dirnames, _files in sorted(os.walk(path), key=lambda e: -len(e[0])):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
