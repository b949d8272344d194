"""The typed views at the decision boundaries (`controller_runtime.kinds`, issue 46).

mypy checks a subscript read of a view (`pv["spce"]` fails the lint) but lets `.get` take any key
(PEP 589), so the `.get` reads through a view are checked here against the fields the views
declare. The string-keyed reads of spec, metadata and status left in runtime code are counted
(`python -m tests.support.typed_reads` prints them per package); the number not through a view
may only go down.
"""

from __future__ import annotations

from pathlib import Path
from typing import get_type_hints

from controller_runtime import kinds
from controller_runtime.resources import Obj
from controller_runtime.volumes import csi_volume
from tests.support.typed_reads import VIEW_NAMES, reads_in, runtime_reads, view_fields

# Untyped string-keyed reads of spec/metadata/status in runtime code: 555 before the views; lower
# it when a module takes them, never raise it.
UNTYPED_AT_MOST = 522


def test_get_reads_through_a_view_name_a_declared_field() -> None:
    fields = view_fields()
    unknown = [r for r in runtime_reads(keys=None) if r.typed and r.get and r.key not in fields]
    assert not unknown, "\n".join(
        f"{r.file}:{r.line}: .get({r.key!r}) is no field of a view" for r in unknown
    )


def test_string_keyed_reads_of_spec_metadata_status_only_go_down() -> None:
    reads = runtime_reads()
    untyped = sum(not r.typed for r in reads)
    print(f"{len(reads)} string-keyed reads of spec/metadata/status, {len(reads) - untyped} through a view")
    assert untyped <= UNTYPED_AT_MOST


def test_a_read_is_typed_through_a_parameter_a_conversion_or_an_annotation(tmp_path: Path) -> None:
    source = """
def f(pv: PersistentVolume, obj: Obj) -> None:
    pv["spec"]
    (pv.get("spec") or {}).get("csi")
    obj["spec"]
    node = node_view(obj)
    node.get("status")
    claim: PersistentVolumeClaim | None = None
    claim["metadata"]

    def inner() -> None:
        pv["status"]
"""
    path = tmp_path / "m.py"
    path.write_text(source)
    reads = reads_in(path, tmp_path)
    assert sorted((r.line, r.key, r.typed) for r in reads) == [
        (3, "spec", True),
        (4, "spec", True),
        (5, "spec", False),
        (7, "status", True),
        (9, "metadata", True),
        (12, "status", True),
    ]


def test_every_view_is_a_typed_dict_of_optional_fields() -> None:
    # total=False: an object from the API may omit any field, and the reads must say what then.
    assert {
        "PersistentVolume",
        "PersistentVolumeClaim",
        "Pod",
        "Node",
        "CSIDriver",
        "StorageClass",
        "VolumeAttachment",
    } <= VIEW_NAMES
    for name in VIEW_NAMES:
        view = getattr(kinds, name)
        assert not view.__required_keys__, name
        get_type_hints(view)  # every annotation resolves


def test_a_view_is_the_object_itself() -> None:
    obj: Obj = {"metadata": {"name": "pv"}, "spec": {"csi": {"driver": "d", "volumeHandle": "h"}}}
    view = kinds.pv_view(obj)
    vol = csi_volume(view)
    assert view is obj and kinds.pv_view(None) is None  # a cast: no copy
    assert vol is not None and (vol.pv_name, vol.driver, vol.handle) == ("pv", "d", "h")
