"""The typed views at the decision boundaries (`controller_runtime.kinds`, issue 46).

mypy checks a subscript read of a view (`pv["spce"]` fails the lint) but lets `.get` take any key
(PEP 589), so the `.get` reads of a view are checked here, in mypy's own types of the runtime
packages (`tests.support.typed_reads`), against the fields the view declares. The string-keyed
reads of spec, metadata and status that remain reads of a plain dict are counted
(`python -m tests.support.typed_reads` prints the numbers); that count may only go down.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, get_type_hints

import pytest

from controller_runtime import kinds
from controller_runtime.resources import Obj
from controller_runtime.toolchain import REPO_ROOT
from controller_runtime.volumes import csi_volume
from tests.support.typed_reads import Read, counts, runtime_reads

# Reads of spec/metadata/status in runtime code that are reads of a plain dict: 546 of 546 before
# the views. Lower it when code takes them; never raise it.
PLAIN_AT_MOST = 114

VIEWS: dict[str, Any] = {
    name: value
    for name, value in vars(kinds).items()
    if isinstance(value, type) and issubclass(value, dict) and value.__module__ == kinds.__name__
}


@pytest.fixture(scope="module")
def reads() -> list[Read]:
    return runtime_reads()


def test_no_get_of_a_view_names_a_field_the_view_lacks(reads: list[Read]) -> None:
    unknown = sorted({(r.key, r.line) for r in reads if r.unknown})
    assert not unknown, f".get of a view with a key none of its fields has (key, line): {unknown}"


def test_reads_of_a_plain_dict_only_go_down(reads: list[Read]) -> None:
    total, typed = counts(reads)
    print(f"{total} string-keyed reads of spec/metadata/status, {typed} through a view")
    assert total - typed <= PLAIN_AT_MOST


def test_the_count_tells_a_view_from_a_dict_and_catches_a_misspelt_get(tmp_path: Path) -> None:
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "m.py").write_text(
        "from controller_runtime.kinds import PersistentVolume\n"
        "from controller_runtime.resources import Obj\n"
        "\n"
        "\n"
        "def f(pv: PersistentVolume | None, obj: Obj) -> object:\n"
        '    return ((pv or {}).get("spce"), (pv or {}).get("spec"), obj["spec"])\n'
    )
    found = sorted((r.key, r.typed, r.unknown) for r in runtime_reads(tmp_path))
    assert found == [("spce", True, True), ("spec", False, False), ("spec", True, False)]


def test_every_view_is_a_typed_dict_of_optional_fields() -> None:
    # total=False: an object from the API may omit any field, and every read says what then.
    decided_on = {"PersistentVolume", "PersistentVolumeClaim", "VolumeAttachment", "Pod", "Node"}
    snapshots = {"VolumeSnapshot", "VolumeSnapshotContent"}
    assert decided_on | snapshots | {"StorageClass", "CSIDriver", "CSINode"} <= set(VIEWS)
    for name, view in VIEWS.items():
        assert not view.__required_keys__, name
        get_type_hints(view)  # every annotation resolves


def test_a_view_is_the_object_itself() -> None:
    obj: Obj = {"metadata": {"name": "pv"}, "spec": {"csi": {"driver": "d", "volumeHandle": "h"}}}
    view = kinds.pv_view(obj)
    vol = csi_volume(view)
    assert view is obj and kinds.pv_view(None) is None  # a cast: no copy
    assert vol is not None and (vol.pv_name, vol.driver, vol.handle) == ("pv", "d", "h")
