"""kubeloop's sidecars ask for no more than upstream's published RBAC (issue 51): every permission that
deploy/rbac/ and the Helm chart grant the external-attacher, external-provisioner and external-resizer
must be in the rbac.yaml of the Go sidecar it replaces (the copies the Kubernetes e2e suite ships in
k8s.io/kubernetes@KUBERNETES_VERSION/test/e2e/testing-manifests/storage-csi/, from the Go module
cache), or be one of the EXTRAS below, each with its reason. tests/integration/test_upstream_rbac.py
runs the sidecars under upstream's files, unchanged."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import yaml

from controller_runtime.toolchain import REPO_ROOT
from tests.support.helm import helm_template, objects
from tests.support.upstream_rbac import storage_csi

# (apiGroup, resource, verb, cluster-wide): a grant of a ClusterRole through a ClusterRoleBinding is
# cluster-wide; one of a Role (in the sidecar's own namespace) is not.
Grant = tuple[str, str, str, bool]

SIDECARS = {  # kubeloop's ServiceAccount: upstream's storage-csi directory
    "kubeloop-external-attacher": "external-attacher",
    "kubeloop-external-provisioner": "external-provisioner",
    "kubeloop-external-resizer": "external-resizer",
}

# What kubeloop grants beyond upstream's rbac.yaml, and why. Each is optional: the sidecar works
# without it except in the case the reason names.
EXTRAS: dict[str, dict[tuple[str, str, str], str]] = {
    "kubeloop-external-attacher": {},
    "kubeloop-external-provisioner": {
        ("", "secrets", "get"): "classes naming csi.storage.k8s.io/provisioner-secret-* (upstream's "
        "rbac.yaml has the rule, commented out, for drivers that need it)",
        ("storage.k8s.io", "volumeattributesclasses", "get"): "claims naming a VolumeAttributesClass: "
        "csi-provisioner reads it too (pkg/controller/controller.go), its rbac.yaml does not grant it",
        ("snapshot.storage.k8s.io", "volumesnapshots", "patch"): "restores from a snapshot: the "
        "source-protection finalizer (csi-provisioner updates the snapshot; its rbac.yaml grants neither)",
        ("apps", "daemonsets", "get"): "--node-deployment and capacity ownership: the owner chain walk",
        ("apps", "statefulsets", "get"): "--node-deployment and capacity ownership: the owner chain walk",
        ("apps", "deployments", "get"): "--node-deployment and capacity ownership: the owner chain walk",
    },
    "kubeloop-external-resizer": {
        ("", "nodes", "get"): "--node-deployment: the resizer watches its own Node",
        ("", "nodes", "list"): "--node-deployment: the resizer watches its own Node",
        ("", "nodes", "watch"): "--node-deployment: the resizer watches its own Node",
    },
}


def grants_of(docs: Iterable[dict[str, Any]], account: str) -> set[Grant]:
    """Every (group, resource, verb, cluster-wide) the objects grant the ServiceAccount `account`."""
    docs = [d for d in docs if d]
    roles = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d for d in docs}
    out: set[Grant] = set()
    for binding in docs:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        subjects = binding.get("subjects") or []
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account for s in subjects):
            continue
        ref = binding["roleRef"]
        namespace = "" if ref["kind"] == "ClusterRole" else binding["metadata"].get("namespace", "")
        role = roles[(ref["kind"], namespace, ref["name"])]
        cluster_wide = binding["kind"] == "ClusterRoleBinding"
        for rule in role.get("rules") or []:
            for group in rule.get("apiGroups") or [""]:
                for resource in rule["resources"]:
                    out |= {(group, resource, verb, cluster_wide) for verb in rule["verbs"]}
    return out


def beyond(kubeloop: set[Grant], upstream: set[Grant]) -> set[Grant]:
    """kubeloop's grants upstream's do not cover (a cluster-wide grant covers a namespaced one)."""
    return {g for g in kubeloop if g not in upstream and (g[3] or (g[0], g[1], g[2], True) not in upstream)}


def upstream_grants(account: str) -> set[Grant]:
    directory = SIDECARS[account]
    path = storage_csi() / directory / "rbac.yaml"
    assert path.is_file(), f"{path} is missing from the Go module cache"
    docs = list(yaml.safe_load_all(path.read_text()))
    [sa] = [d for d in docs if d and d["kind"] == "ServiceAccount"]
    return grants_of(docs, sa["metadata"]["name"])


def deploy_rbac() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((REPO_ROOT / "deploy" / "rbac").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def check(account: str, docs: list[dict[str, Any]], where: str) -> None:
    mine = grants_of(docs, account)
    assert mine, f"{where} grants {account} nothing: is it still its ServiceAccount?"
    extra = {g for g in beyond(mine, upstream_grants(account)) if g[:3] not in EXTRAS[account]}
    assert not extra, f"{where} grants {account} more than upstream's rbac.yaml: {sorted(extra)}"


@pytest.mark.parametrize("account", sorted(SIDECARS))
def test_deploy_rbac_asks_for_no_more_than_upstream(account: str) -> None:
    check(account, deploy_rbac(), "deploy/rbac")


@pytest.mark.parametrize("account", sorted(SIDECARS))
@pytest.mark.parametrize(
    ("mode", "controllers"), [("shared", "cluster"), ("shared", "kubeloop"), ("node-local", "kubeloop")]
)
def test_the_charts_rbac_asks_for_no_more_than_upstream(account: str, mode: str, controllers: str) -> None:
    chart = helm_template(f"mode={mode}", f"storageControllers={controllers}", flags=["--skip-tests"])
    docs = list(objects(chart.stdout).values())
    if account == "kubeloop-external-attacher" and mode == "node-local":
        assert not grants_of(docs, account), "node-local mode runs no attacher"
        return
    check(account, docs, f"the chart ({mode}, {controllers})")


def test_every_extra_is_still_needed() -> None:
    """An extra the files no longer grant is stale: drop it from EXTRAS."""
    docs = deploy_rbac()
    for account, extras in EXTRAS.items():
        mine = {g[:3] for g in grants_of(docs, account)}
        assert set(extras) <= mine, f"{account}: {sorted(set(extras) - mine)} no longer granted"


def test_upstream_attacher_patches_and_never_updates() -> None:
    """The grant the attacher's writes were changed for (its PV and VA writes are patches)."""
    upstream = upstream_grants("kubeloop-external-attacher")
    for resource in ("persistentvolumes", "volumeattachments"):
        assert (
            "storage.k8s.io" if resource == "volumeattachments" else "",
            resource,
            "patch",
            True,
        ) in upstream
        assert not {g for g in upstream if g[1] == resource and g[2] == "update"}
