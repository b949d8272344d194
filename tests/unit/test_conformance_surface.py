"""The conformance suite's API-surface check (tests/conformance/surface.py): two runs are compared
only when their clusters served the same APIs. Issue 44: the go mode ran without the snapshot CRDs
and the kubeloop mode with them, and a scenario differed for that reason alone."""

from __future__ import annotations

import json

import pytest

from tests.conformance.surface import SurfaceMismatch, api_surface, check_same_surface

CORE = ["v1/persistentvolumeclaims", "v1/pods", "storage.k8s.io/v1/volumeattachments"]
SNAPSHOTS = [
    "snapshot.storage.k8s.io/v1/volumesnapshotcontents",
    "snapshot.storage.k8s.io/v1/volumesnapshots",
]


def test_the_same_surface_is_compared() -> None:
    check_same_surface({"go": sorted(CORE + SNAPSHOTS), "kubeloop": sorted(CORE + SNAPSHOTS)})


def test_a_missing_crd_refuses_the_comparison_and_names_what_differs() -> None:
    with pytest.raises(SurfaceMismatch) as err:
        check_same_surface({"go": sorted(CORE), "kubeloop": sorted(CORE + SNAPSHOTS)})
    text = str(err.value)
    assert "go and kubeloop runs" in text
    for resource in SNAPSHOTS:
        assert f"+{resource}" in text
    assert "v1/pods" not in text  # only the difference is listed


def test_a_resource_only_the_first_mode_serves_is_named_too() -> None:
    with pytest.raises(SurfaceMismatch, match=r"-storage.k8s.io/v1/volumeattachments"):
        check_same_surface({"go": sorted(CORE), "kubeloop": ["v1/persistentvolumeclaims", "v1/pods"]})


class Discovery:
    """An apiserver's discovery documents by path: all api_surface reads."""

    def __init__(self, docs: dict[str, object]) -> None:
        self.docs = docs

    async def get_text(self, path: str) -> str:
        return json.dumps(self.docs[path])


async def test_api_surface_lists_every_resource_of_every_group_version() -> None:
    api = Discovery(
        {
            "/api": {"versions": ["v1"]},
            "/api/v1": {"groupVersion": "v1", "resources": [{"name": "pods"}, {"name": "pods/status"}]},
            "/apis": {
                "groups": [
                    {"name": "storage.k8s.io", "versions": [{"groupVersion": "storage.k8s.io/v1"}]},
                    {
                        "name": "snapshot.storage.k8s.io",
                        "versions": [{"groupVersion": "snapshot.storage.k8s.io/v1"}],
                    },
                ]
            },
            "/apis/storage.k8s.io/v1": {
                "groupVersion": "storage.k8s.io/v1",
                "resources": [{"name": "volumeattachments"}],
            },
            "/apis/snapshot.storage.k8s.io/v1": {
                "groupVersion": "snapshot.storage.k8s.io/v1",
                "resources": [{"name": "volumesnapshots"}],
            },
        }
    )
    assert await api_surface(api) == [  # type: ignore[arg-type]
        "snapshot.storage.k8s.io/v1/volumesnapshots",
        "storage.k8s.io/v1/volumeattachments",
        "v1/pods",
        "v1/pods/status",
    ]
