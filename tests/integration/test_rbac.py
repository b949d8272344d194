"""Least privilege, checked against the real apiserver: every deploy/rbac/*.yaml is applied and
`kubectl auth can-i --as system:serviceaccount:kube-system:<sa>` must say *no* to what each
component must never do (and *yes* to a few things it needs, so a broken check cannot pass)."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from controller_runtime.toolchain import REPO_ROOT
from localstack.controlplane import ControlPlane
from localstack.snapshotter import snapshot_crds, snapshot_metadata_crd

from .provisioner_harness import kubectl

pytestmark = pytest.mark.integration

# (verb, resource[/subresource], namespace or "")
Check = tuple[str, str, str]
VA = "volumeattachments.storage.k8s.io"
LEASES = "leases.coordination.k8s.io"
# external-snapshotter's objects: the test installs their CRDs, without which kubectl cannot resolve
# the names and every answer about them would be a meaningless "no".
VS = "volumesnapshots.snapshot.storage.k8s.io"
VSC = "volumesnapshotcontents.snapshot.storage.k8s.io"
VGS = "volumegroupsnapshots.groupsnapshot.storage.k8s.io"
VGSC = "volumegroupsnapshotcontents.groupsnapshot.storage.k8s.io"
SMS = "snapshotmetadataservices.cbt.storage.k8s.io"  # external-snapshot-metadata's CRD
VAC = "volumeattributesclasses.storage.k8s.io"

# What no storage component may ever do.
EVERYONE_MUST_NOT: list[Check] = [
    ("*", "*", ""),
    ("get", "secrets", "default"),
    ("list", "secrets", ""),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", ""),
    ("escalate", "clusterroles.rbac.authorization.k8s.io", ""),
    ("impersonate", "serviceaccounts", "kube-system"),
    ("create", "pods/exec", "default"),
    ("delete", "nodes", ""),
    ("create", LEASES, "default"),  # leader election leases live in kube-system only
    ("delete", "namespaces", ""),
    ("update", "persistentvolumeclaims/status", ""),
]
# ... except for the one component whose job it is.
EXCEPT: dict[Check, str] = {
    ("get", "secrets", "default"): "kubeloop-external-provisioner",  # provisioner secrets
    ("create", LEASES, "default"): "kubeloop-node-agent",  # node leases (kube-node-lease)
    ("update", "persistentvolumeclaims/status", ""): "kubeloop-pv-controller",  # the binder
}

MUST_NOT: dict[str, list[Check]] = {
    "kubeloop-pv-controller": [
        ("create", VA, ""),
        ("delete", VA, ""),
        ("create", "persistentvolumes", ""),
        ("delete", "persistentvolumes", ""),
        ("delete", "persistentvolumeclaims", "default"),
        ("create", "pods", "default"),
        ("patch", "nodes/status", ""),
    ],
    "kubeloop-attach-detach": [
        ("delete", "persistentvolumes", ""),
        ("update", "persistentvolumes", ""),
        ("create", "persistentvolumes", ""),
        ("patch", "volumeattachments/status", ""),
        ("update", "persistentvolumeclaims", "default"),
        ("delete", "pods", "default"),
    ],
    "kubeloop-external-provisioner": [
        ("create", VA, ""),
        ("delete", VA, ""),
        ("update", "persistentvolumes", ""),
        ("patch", "persistentvolumeclaims/status", "default"),
        ("list", "secrets", "default"),
        ("delete", "pods", "default"),
        ("create", "csinodes.storage.k8s.io", ""),
    ],
    "kubeloop-external-attacher": [
        ("delete", "persistentvolumes", ""),
        ("create", "persistentvolumes", ""),
        ("create", VA, ""),
        ("delete", VA, ""),
        ("get", "secrets", "kube-system"),
        ("patch", "persistentvolumeclaims", "default"),
        ("delete", "pods", "default"),
    ],
    "kubeloop-external-resizer": [
        ("delete", "persistentvolumes", ""),
        ("create", "persistentvolumes", ""),
        ("patch", "persistentvolumeclaims", "default"),  # the claim's spec is the user's
        ("create", VA, ""),
        ("get", "secrets", "kube-system"),
        ("delete", "pods", "default"),
    ],
    "kubeloop-volume-expand": [
        ("patch", "persistentvolumes", ""),
        ("patch", "persistentvolumeclaims/status", "default"),
        ("update", "persistentvolumeclaims", "default"),
        ("create", VA, ""),
        ("get", "secrets", "kube-system"),
    ],
    "kubeloop-node-agent": [
        ("delete", "persistentvolumes", ""),
        ("create", "persistentvolumes", ""),
        ("update", "persistentvolumes", ""),
        ("create", VA, ""),
        ("delete", VA, ""),
        ("update", "persistentvolumeclaims", "default"),
        ("get", "secrets", "kube-system"),
        ("create", "pods", "default"),
    ],
    # Node-local mode's clean-up after a deleted Node: it deletes claims and PVs, but makes none
    # and changes no spec, and of a Node only its finalizer list.
    "kubeloop-node-finalizer": [
        ("create", "persistentvolumes", ""),
        ("update", "persistentvolumes", ""),
        ("create", "persistentvolumeclaims", "default"),
        ("update", "persistentvolumeclaims", "default"),
        ("update", "nodes", ""),
        ("patch", "nodes/status", ""),
        ("create", VA, ""),
        ("delete", VA, ""),
        ("delete", "pods", "default"),
        ("get", "secrets", "kube-system"),
        ("update", "csidrivers.storage.k8s.io", ""),
    ],
    # external-snapshotter's two (deploy/kubernetes): snapshots, not volumes.
    "kubeloop-snapshot-controller": [
        ("create", "persistentvolumes", ""),
        ("delete", "persistentvolumes", ""),
        ("delete", "persistentvolumeclaims", "default"),
        ("create", VA, ""),
        ("get", "secrets", "kube-system"),
        ("delete", "pods", "default"),
    ],
    "kubeloop-csi-snapshotter": [
        ("create", VS, "default"),
        ("create", VGS, "default"),
        ("create", VGSC, ""),
        ("delete", VSC, ""),
        ("create", VSC, ""),
        ("update", "persistentvolumeclaims", "default"),
        ("create", "persistentvolumes", ""),
        ("get", "secrets", "kube-system"),
    ],
    # external-snapshot-metadata's sidecar and its init container: reviews, and snapshots to read.
    "kubeloop-csi-snapshot-metadata": [
        ("delete", SMS, ""),
        ("list", SMS, ""),
        ("update", VSC, ""),
        ("create", VS, "default"),
        ("delete", "persistentvolumes", ""),
        ("get", "secrets", "kube-system"),
    ],
}

MUST: dict[str, list[Check]] = {
    "kubeloop-pv-controller": [("update", "persistentvolumes", ""), ("get", LEASES, "kube-system")],
    "kubeloop-attach-detach": [("create", VA, ""), ("delete", VA, "")],
    "kubeloop-external-provisioner": [
        ("create", "persistentvolumes", ""),
        ("delete", "persistentvolumes", ""),
        ("get", "secrets", "default"),
        ("get", VAC, ""),  # a claim's VolumeAttributesClass, read at CreateVolume
    ],
    "kubeloop-external-attacher": [
        ("patch", "volumeattachments/status", ""),
        ("patch", "persistentvolumes", ""),
    ],
    # With --node-deployment it watches its own Node (deploy/rbac/node-deployment.yaml).
    "kubeloop-external-resizer": [
        ("patch", "persistentvolumeclaims/status", "default"),
        ("watch", "nodes", ""),
        ("watch", VAC, ""),  # the modify controller
    ],
    "kubeloop-volume-expand": [("list", "persistentvolumeclaims", "")],
    "kubeloop-node-agent": [("patch", "pods/status", "default"), ("patch", "nodes/status", "")],
    "kubeloop-node-finalizer": [
        ("patch", "nodes", ""),
        ("delete", "persistentvolumes", ""),
        ("get", "persistentvolumes", ""),  # a finalizer patch that conflicted reads the PV again
        ("delete", "persistentvolumeclaims", "default"),
        ("patch", "persistentvolumeclaims", "default"),  # a waiting claim's selected-node
        ("get", "csidrivers.storage.k8s.io", ""),
        ("update", LEASES, "kube-system"),
    ],
    "kubeloop-snapshot-controller": [
        ("create", VSC, ""),
        ("update", "persistentvolumeclaims", "default"),
        ("create", VGSC, ""),
        ("update", VGS, "default"),
    ],
    "kubeloop-csi-snapshotter": [("update", VSC, ""), ("get", LEASES, "kube-system"), ("update", VGSC, "")],
    "kubeloop-csi-snapshot-metadata": [
        ("create", "tokenreviews.authentication.k8s.io", ""),
        ("create", "subjectaccessreviews.authorization.k8s.io", ""),
        ("get", VS, "default"),
        ("get", VSC, ""),
        ("create", SMS, ""),
    ],
}


async def can_i(cp: ControlPlane, sa: str, check: Check, gate: asyncio.Semaphore) -> bool:
    verb, resource, namespace = check
    args = [f"--kubeconfig={cp.admin_kubeconfig}", "auth", "can-i", verb]
    name, _, sub = resource.partition("/")
    if sub:
        # "volumeattachments/status" needs its group: split "<plural>.<group>" back out.
        name = VA if name == "volumeattachments" else name
        args += [name, f"--subresource={sub}"]
    else:
        args.append(name)
    args += ["--namespace", namespace] if namespace else ["--all-namespaces"]
    args.append(f"--as=system:serviceaccount:kube-system:{sa}")
    async with gate:
        proc = await asyncio.create_subprocess_exec(
            str(cp.toolchain.binary("kubectl")),
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
    answer = out.decode().strip()
    # can-i exits 0 for yes and 1 for no; anything else (bad resource, apiserver down) is an error.
    assert answer in ("yes", "no") and proc.returncode in (0, 1), (args, answer, err.decode())
    return answer == "yes"


async def test_components_cannot_do_what_they_must_not(control_plane: ControlPlane) -> None:
    crds = [*snapshot_crds(), snapshot_metadata_crd()]
    for path in [*crds, *sorted((REPO_ROOT / "deploy" / "rbac").glob("*.yaml"))]:
        await kubectl(control_plane, "apply", "-f", str(path))
    for crd in crds:
        await kubectl(control_plane, "wait", "--for=condition=established", "--timeout=60s", "-f", str(crd))
    # Every ServiceAccount deploy/rbac declares is checked (node-deployment.yaml declares none: it
    # adds node-local mode's rights to the accounts of other files).
    accounts = {
        doc["metadata"]["name"]
        for path in (REPO_ROOT / "deploy" / "rbac").glob("*.yaml")
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc["kind"] == "ServiceAccount"
    }
    assert set(MUST_NOT) == set(MUST) == accounts
    gate = asyncio.Semaphore(8)
    cases = [
        (sa, c, False)
        for sa, checks in MUST_NOT.items()
        for c in [*EVERYONE_MUST_NOT, *checks]
        if EXCEPT.get(c) != sa
    ]
    cases += [(sa, c, True) for sa, checks in MUST.items() for c in checks]
    answers = await asyncio.gather(*(can_i(control_plane, sa, c, gate) for sa, c, _ in cases))
    wrong = [
        f"{sa} {'cannot' if expected else 'CAN'} {' '.join(c[:2])}{' in ' + c[2] if c[2] else ''}"
        for (sa, c, expected), got in zip(cases, answers, strict=True)
        if got != expected
    ]
    print(f"\n{len(cases)} can-i checks over {len(MUST)} service accounts")
    assert not wrong, "\n".join(wrong)
