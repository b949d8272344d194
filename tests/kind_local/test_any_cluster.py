"""kubeloop on a cluster as users have it (`python -m localstack.kind up --pools separate
--storage-controllers cluster`): kube-controller-manager with every default controller, so kcm binds,
attaches and expands; kubelet in /var/lib/k0s/kubelet; the Helm chart with its defaults but for the
mode, the pool size and kubelet's directory (docs/helm.md).

In order: kcm does the control plane's work for node-local volumes; `helm upgrade` from the previous
chart while a pod writes to a node-local volume; `helm uninstall` keeps the volumes and a new
install serves them; `helm test`. Then the node-local release makes way for the chart in shared
mode (every worker also sees one directory, SHARED_DIR_IN_NODE) for the same with attachments: kcm
attaches, expands, snapshots restore; an upgrade with a writer on a shared volume; and kubeloop's
own three controllers, deployed by mistake next to kcm, standing down. The node-local release is
installed again after them, for the rest of tests/kind_local."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller_runtime.toolchain import REPO_ROOT
from localstack import kind
from tests.support.waits import eventually, no_problems

from ..kind.conftest import KindCluster, scratch_namespace
from ..kind.workloads import CHECK, WRITE, attachments, claim, pod, take_snapshot, volume_of, wait_ready

pytestmark = pytest.mark.root

KCM = "kube-controller-manager"
# The chart before this one (0.1.0, the commit before the version went to 0.2.0): what an upgrade
# starts from. CI's clone has the history.
PREVIOUS_CHART_COMMIT = "acacd62"
# At most this many claims for kubeloop's three controllers to each see kcm's counterpart at work.
CANARIES = 5
KUBELOOP_CONTROLLERS = {
    "kubeloop-pv-controller": "persistentvolume-binder-controller",
    "kubeloop-attach-detach-controller": "persistentvolume-attach-detach-controller",
    "kubeloop-volume-expand-controller": "persistentvolume-expander-controller",
}
# Writes 256 KiB blocks round a set of 32 files, each fsync'd and its checksum written after it,
# until /data/stop appears; then checks every file against its checksum. Any failed write or
# check ends the pod (restartPolicy Never) as Failed.
WRITER = """
i=0
while [ ! -e /data/stop ]; do
  f=/data/f$((i % 32))
  dd if=/dev/urandom of=$f bs=64k count=4 conv=fsync 2>/dev/null || { echo "write $i failed"; exit 1; }
  sha256sum $f > $f.sha || { echo "checksum $i failed"; exit 1; }
  i=$((i + 1))
  echo $i > /data/count
  sleep 0.2
done
sync
for s in /data/f*.sha; do sha256sum -c $s > /dev/null || { echo "$s does not check out"; exit 1; }; done
echo "verified after $i writes"
"""


def helm(kc: KindCluster, *args: str, timeout: float = 420) -> str:
    return kc.cluster.helm(*args, "--namespace", "kube-system", timeout=timeout)


def install(kc: KindCluster, values: list[str]) -> None:
    """`helm install` of this chart as the release, waiting for its pods."""
    helm(kc, "install", kind.HELM_RELEASE, str(kind.HELM_CHART), *values, "--wait", "--timeout=5m")


def node_local_values(kc: KindCluster) -> list[str]:
    return kc.cluster.chart_values()


def shared_values(kc: KindCluster) -> list[str]:
    """The chart's defaults (mode shared) on this cluster: kubelet's directory, and the directory all
    workers share as the pool's."""
    return ["--set", f"kubeletDir={kc.cluster.kubelet_dir}", "--set", f"hostDir={kind.SHARED_DIR_IN_NODE}"]


@pytest.fixture(scope="module")
def previous_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("previous-chart")
    archive = subprocess.run(
        ["git", "archive", PREVIOUS_CHART_COMMIT, "deploy/helm/kubeloop"],
        cwd=REPO_ROOT, capture_output=True, check=True,
    )  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    chart = out / "deploy" / "helm" / "kubeloop"
    previous = yaml.safe_load((chart / "Chart.yaml").read_text())["version"]
    current = yaml.safe_load((kind.HELM_CHART / "Chart.yaml").read_text())["version"]
    assert (previous, current) == ("0.1.0", "0.2.0"), "move PREVIOUS_CHART_COMMIT with the chart's version"
    return chart


def fielded(kc: KindCluster, *args: str) -> dict[str, Any]:
    """`kubectl get` with metadata.managedFields, which it leaves out unless asked."""
    return kc.get(*args, "--show-managed-fields")


def pv_of(kc: KindCluster, ns: str, claim_name: str) -> dict[str, Any]:
    return fielded(kc, "pv", volume_of(kc, ns, claim_name)["metadata"]["name"])


def attachments_of(kc: KindCluster, pv: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        fielded(kc, "volumeattachment", va["metadata"]["name"])
        for va in attachments(kc, pv["metadata"]["name"])
    ]


def managers(obj: dict[str, Any]) -> set[str]:
    return {m["manager"] for m in obj["metadata"].get("managedFields", [])}


def owner_of(obj: dict[str, Any], *path: str) -> set[str]:
    """The managers whose managedFields own the field at `path` (f:spec, f:claimRef, ...)."""
    owners = set()
    for entry in obj["metadata"].get("managedFields", []):
        node = entry.get("fieldsV1", {})
        for part in path:
            node = node.get(f"f:{part}") if isinstance(node, dict) else None
        if node is not None:
            owners.add(entry["manager"])
    return owners


def node_plugin(kc: KindCluster, node: str) -> dict[str, Any]:
    pods = kc.get(
        "pods", "-n", "kube-system", "-l", "app.kubernetes.io/component=csi-node",
        "--field-selector", f"spec.nodeName={node}",
    )["items"]  # fmt: skip
    # During a rollout the old pod may still be terminating beside the new one.
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return max(live, key=lambda p: p["metadata"]["creationTimestamp"]) if live else {}


def ready(pod_obj: dict[str, Any]) -> bool:
    conditions = pod_obj.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) and not pod_obj[
        "metadata"
    ].get("deletionTimestamp")


def writer_pod(ns: str, name: str, claim_name: str) -> str:
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "app",
                    "image": kind.BUSYBOX_IMAGE,
                    "command": ["sh", "-c", WRITER],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }
            ],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim_name}}],
        },
    }
    return json.dumps(manifest)


def writes(kc: KindCluster, ns: str, name: str) -> int:
    out = kc.kubectl("exec", "-n", ns, name, "--", "cat", "/data/count", check=False).strip()
    return int(out) if out.isdigit() else 0


def upgrade_under_a_writer(
    kc: KindCluster, ns: str, storage_class: str, values: list[str], previous_chart: Path
) -> str:
    """The release at the previous chart, a pod writing to a claim of `storage_class`, `helm
    upgrade` to this chart (a log level of its own, so the node plugin is replaced whatever the two
    charts' templates differ in): the plugin on the pod's node is replaced, the pod keeps writing
    with no error and without a restart, and its data checks out. Returns the writer's last words."""
    helm(kc, "upgrade", kind.HELM_RELEASE, str(previous_chart), *values, "--wait", "--timeout=5m")
    kc.apply(claim(ns, "live", storage_class=storage_class))
    kc.apply(writer_pod(ns, "writer", "live"))
    wait_ready(kc, ns, "writer")
    node = kc.get("pod", "-n", ns, "writer")["spec"]["nodeName"]
    eventually(
        "the writer's first writes", partial(writes, kc, ns, "writer"), 120, 0.5, satisfied=lambda n: n >= 5
    )
    before = node_plugin(kc, node)["metadata"]["uid"]
    helm(kc, "upgrade", kind.HELM_RELEASE, str(kind.HELM_CHART), *values, "--set", "logLevel=3",
         "--wait", "--timeout=5m")  # fmt: skip
    eventually(
        f"a new node plugin on {node}",
        lambda: (p := node_plugin(kc, node)) and p["metadata"]["uid"] != before and ready(p),
        240,
        0.5,
    )
    upgraded_at = writes(kc, ns, "writer")
    eventually(
        "writes after the upgrade",
        partial(writes, kc, ns, "writer"),
        120,
        0.5,
        satisfied=lambda n: n >= upgraded_at + 10,
    )
    kc.kubectl("exec", "-n", ns, "writer", "--", "touch", "/data/stop")
    phase = eventually(
        "the writer to stop and check its data",
        lambda: kc.get("pod", "-n", ns, "writer")["status"]["phase"],
        120,
        0.5,
        satisfied=lambda phase: phase in ("Succeeded", "Failed"),
    )
    said = kc.kubectl("logs", "-n", ns, "writer")
    assert phase == "Succeeded", f"the writer ended {phase}: {said}"
    assert said.strip().startswith("verified after"), said
    return said.strip()


def wait_no_volume_of_claim(kc: KindCluster, ns: str, claim_name: str) -> None:
    def gone() -> bool:
        return not [
            pv
            for pv in kc.get("pv")["items"]
            if (pv["spec"].get("claimRef") or {}).get("name") == claim_name
            and pv["spec"]["claimRef"].get("namespace") == ns
        ]

    eventually(f"the volume of {ns}/{claim_name} to be deleted", gone, 120, 0.5)


def helm_test(kc: KindCluster) -> None:
    """`helm test` passes, and the volume it made is deleted after it."""
    out = helm(kc, "test", kind.HELM_RELEASE, "--timeout=4m")  # exits non-zero when the test fails
    assert "Succeeded" in out, out
    wait_no_volume_of_claim(kc, "kube-system", f"{kind.HELM_RELEASE}-test-volume")


def registered(kc: KindCluster, node: str) -> bool:
    listed = kc.node_exec(node, "ls", f"{kind.ELSEWHERE_KUBELET_DIR}/plugins_registry", check=False)
    return "loop.csi.kubeloop.dev-reg.sock" in listed.split()


def test_kcm_binds_node_local_volumes_with_kubelet_elsewhere(
    local_cluster: KindCluster, namespace: str
) -> None:
    kc, ns = local_cluster, namespace
    kcm = kc.get("pod", "-n", "kube-system", f"{KCM}-{kind.CLUSTER_NAME}-control-plane")
    command = kcm["spec"]["containers"][0]["command"]
    assert not [c for c in command if c.startswith("--controllers=") and "persistentvolume" in c], command
    for node in kc.workers():
        flags = kc.node_exec(node, "cat", "/var/lib/kubelet/kubeadm-flags.env")
        assert f"--root-dir={kind.ELSEWHERE_KUBELET_DIR}" in flags, flags
        # The registrar has no readiness probe: its pod is Ready before its socket is made.
        eventually(
            f"the registrar's socket in {node}'s {kind.ELSEWHERE_KUBELET_DIR}/plugins_registry",
            partial(registered, kc, node),
            120,
            0.5,
        )
    workloads = kc.kubectl("get", "deployments", "-n", "kube-system", "-o", "name").split()
    assert not [w for w in workloads if w.split("/", 1)[1] in KUBELOOP_CONTROLLERS], workloads

    kc.apply(claim(ns, "data", storage_class="kubeloop-wffc"))
    kc.apply(pod(ns, "app", "data", None, WRITE))
    wait_ready(kc, ns, "app")
    pv = pv_of(kc, ns, "data")
    # kcm's binder bound both sides (the provisioner made the PV with its claimRef, as upstream's
    # does), and the pod's volume sits under kubelet's own directory.
    assert owner_of(pv, "status", "phase") == {KCM}, pv["metadata"]["managedFields"]
    assert owner_of(fielded(kc, "pvc", "-n", ns, "data"), "spec", "volumeName") == {KCM}
    node = kc.get("pod", "-n", ns, "app")["spec"]["nodeName"]
    mounts = kc.node_exec(node, "findmnt", "-rn", "-o", "TARGET")
    assert [m for m in mounts.splitlines() if m.startswith(f"{kind.ELSEWHERE_KUBELET_DIR}/pods/")], mounts
    assert attachments(kc, pv["metadata"]["name"]) == []  # node-local: nothing to attach


def test_upgrade_from_the_previous_chart_under_a_node_local_writer(
    local_cluster: KindCluster, namespace: str, previous_chart: Path
) -> None:
    said = upgrade_under_a_writer(local_cluster, namespace, "kubeloop-wffc", node_local_values(local_cluster),
                                  previous_chart)  # fmt: skip
    print(f"node-local writer: {said}")


def test_uninstall_keeps_the_volumes_and_a_new_install_serves_them(
    local_cluster: KindCluster, namespace: str
) -> None:
    kc, ns = local_cluster, namespace
    kc.apply(claim(ns, "kept", storage_class="kubeloop-wffc"))
    kc.apply(pod(ns, "before", "kept", None, WRITE))
    wait_ready(kc, ns, "before")
    node = kc.get("pod", "-n", ns, "before")["spec"]["nodeName"]
    kc.kubectl("delete", "pod", "-n", ns, "before", "--wait=true", "--timeout=120s", timeout=150)
    pv = volume_of(kc, ns, "kept")
    handle = pv["spec"]["csi"]["volumeHandle"]

    helm(kc, "uninstall", kind.HELM_RELEASE, "--wait", "--timeout=5m")
    # The garbage collector deletes the workloads' pods after them.
    eventually(
        "kubeloop's pods to go",
        lambda: kc.kubectl(
            "get", "pods", "-n", "kube-system", "-l", "app.kubernetes.io/name=kubeloop", "-o", "name"
        ),
        120,
        0.5,
        satisfied=no_problems,
    )
    assert kc.get("pv", pv["metadata"]["name"])["status"]["phase"] == "Bound"
    assert (kc.cluster.pool_dir(node) / "volumes" / f"{handle}.img").exists()

    install(kc, node_local_values(kc))
    kc.apply(pod(ns, "after", "kept", None, CHECK))
    wait_ready(kc, ns, "after")  # CHECK exits unless the data checks out
    assert kc.get("pod", "-n", ns, "after")["spec"]["nodeName"] == node
    helm_test(kc)


def no_volumes_left(kc: KindCluster) -> None:
    """Waits until the release has deleted (and detached) every volume of the claims the tests
    deleted: a release uninstalled before then would leave them to a driver of the other mode."""
    eventually(
        "every PV and VolumeAttachment to go",
        lambda: kc.kubectl("get", "pv,volumeattachments", "-o", "name").split(),
        180,
        0.5,
        satisfied=no_problems,
    )


@pytest.fixture(scope="module")
def shared_release(local_cluster: KindCluster) -> Iterator[KindCluster]:
    """The node-local release replaced by the chart in shared mode; the node-local one installed
    again after the module's tests."""
    kc = local_cluster
    no_volumes_left(kc)
    helm(kc, "uninstall", kind.HELM_RELEASE, "--wait", "--timeout=5m")
    try:
        install(kc, shared_values(kc))
        yield kc
    finally:
        no_volumes_left(kc)
        helm(kc, "uninstall", kind.HELM_RELEASE, "--wait", "--timeout=5m")
        install(kc, node_local_values(kc))


@pytest.fixture
def shared_namespace(shared_release: KindCluster) -> Iterator[str]:
    with scratch_namespace(shared_release) as name:
        yield name


def two_claims_pod(ns: str, name: str) -> str:
    """One pod with an Immediate claim (`imm`, at /data) and a WaitForFirstConsumer one (`late`)."""
    text = pod(ns, name, "imm", None, WRITE)
    text = text.replace(
        "volumeMounts: [{name: data, mountPath: /data}]",
        "volumeMounts: [{name: data, mountPath: /data}, {name: late, mountPath: /late}]",
    )
    return text + "    - name: late\n      persistentVolumeClaim: {claimName: late}\n"


def test_shared_mode_next_to_kcm(shared_release: KindCluster, shared_namespace: str) -> None:
    kc, ns = shared_release, shared_namespace
    kc.apply(claim(ns, "imm", storage_class="kubeloop"))
    kc.apply(claim(ns, "late", storage_class="kubeloop-wffc"))
    kc.apply(two_claims_pod(ns, "app"))
    wait_ready(kc, ns, "app")
    node = kc.get("pod", "-n", ns, "app")["spec"]["nodeName"]
    for name in ("imm", "late"):
        pv = pv_of(kc, ns, name)
        assert owner_of(pv, "status", "phase") == {KCM}, pv["metadata"]["managedFields"]
        assert owner_of(fielded(kc, "pvc", "-n", ns, name), "spec", "volumeName") == {KCM}
        (va,) = attachments_of(kc, pv)
        assert va["spec"]["nodeName"] == node and va["status"]["attached"]
        assert KCM in owner_of(va, "spec", "source"), va["metadata"]["managedFields"]  # kcm attached it

    # Expansion: kcm's expander leaves a CSI volume to the external-resizer, which grows the volume;
    # the chart's classes are ext4, whose online grow needs CAP_SYS_RESOURCE this sandbox may not
    # give the plugin (docs/expansion.md), so the filesystem grows when a new pod stages it.
    grow(kc, ns, "imm", "128Mi")
    kc.kubectl("delete", "pod", "-n", ns, "app", "--wait=true", "--timeout=120s", timeout=150)
    kc.apply(pod(ns, "grown", "imm", None, CHECK))
    wait_ready(kc, ns, "grown")
    eventually(
        "the claim's capacity to reach 128Mi",
        lambda: kc.get("pvc", "-n", ns, "imm")["status"].get("capacity", {}).get("storage"),
        180,
        0.5,
        satisfied=lambda capacity: capacity == "128Mi",
    )
    take_snapshot(kc, ns, "snap", "imm", timeout=180)
    restored = claim(ns, "restored", size="128Mi", storage_class="kubeloop")
    restored += "  dataSource: {name: snap, kind: VolumeSnapshot, apiGroup: snapshot.storage.k8s.io}\n"
    kc.apply(restored)
    kc.apply(pod(ns, "check", "restored", None, CHECK))
    wait_ready(kc, ns, "check")
    kc.kubectl("delete", "volumesnapshot", "-n", ns, "snap", "--wait=true", "--timeout=120s", timeout=150)


def test_upgrade_from_the_previous_chart_under_a_shared_writer(
    shared_release: KindCluster, shared_namespace: str, previous_chart: Path
) -> None:
    said = upgrade_under_a_writer(shared_release, shared_namespace, "kubeloop", shared_values(shared_release),
                                  previous_chart)  # fmt: skip
    print(f"shared writer: {said}")
    helm_test(shared_release)


def reports(kc: KindCluster, deployment: str, line: str) -> bool:
    return line in controller_metric(kc, deployment)


def controller_metric(kc: KindCluster, deployment: str) -> str:
    script = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8080/metrics').read().decode())"
    out = kc.kubectl(
        "exec", "-n", "kube-system", f"deploy/{deployment}", "--", "python3", "-c", script, check=False
    )
    return "\n".join(line for line in out.splitlines() if line.startswith("kubeloop_kcm_counterpart_active{"))


def grown_claim(kc: KindCluster, ns: str, name: str, size: str) -> None:
    """A claim with a pod writing to it, then grown to `size`: kcm's binder, attach-detach and
    expander each have something to do."""
    kc.apply(claim(ns, name, storage_class="kubeloop"))
    kc.apply(pod(ns, f"{name}-app", name, None, WRITE))
    wait_ready(kc, ns, f"{name}-app")
    grow(kc, ns, name, size)


def grow(kc: KindCluster, ns: str, name: str, size: str) -> None:
    """Asks for `size` and waits for the volume to have it (the external-resizer's
    ControllerExpandVolume; the filesystem follows at kubelet's next NodeExpandVolume)."""
    patch = json.dumps({"spec": {"resources": {"requests": {"storage": size}}}})
    kc.kubectl("patch", "pvc", "-n", ns, name, "--type=merge", "-p", patch)
    eventually(
        f"claim {name}'s volume to reach {size}",
        lambda: volume_of(kc, ns, name)["spec"]["capacity"]["storage"],
        180,
        0.5,
        satisfied=lambda capacity: capacity == size,
    )


def kubeloop_writes(kc: KindCluster, ns: str, claim_name: str) -> list[tuple[str, str, list[str]]]:
    """Which of kubeloop's three controllers wrote to a claim, its volume or its attachments."""
    pv = pv_of(kc, ns, claim_name)
    objs = [pv, fielded(kc, "pvc", "-n", ns, claim_name), *attachments_of(kc, pv)]
    return [
        (o["kind"], o["metadata"]["name"], sorted(managers(o) & set(KUBELOOP_CONTROLLERS)))
        for o in objs
        if managers(o) & set(KUBELOOP_CONTROLLERS)
    ]


def test_kubeloops_controllers_deployed_by_mistake_stand_down(
    shared_release: KindCluster, shared_namespace: str
) -> None:
    """Each of the three learns of kcm's counterpart from what kcm writes for the first claims (which
    it may have raced kcm for: kubeloop_writes says), says so (metric, log line naming kcm's flag,
    Warning), and from then on writes nothing: the next claim is bound, attached and grown by kcm
    alone."""
    kc, ns = shared_release, shared_namespace
    values = shared_values(kc)
    helm(
        kc,
        "upgrade",
        kind.HELM_RELEASE,
        str(kind.HELM_CHART),
        *values,
        "--set",
        "storageControllers=kubeloop",
    )
    try:
        for deployment in KUBELOOP_CONTROLLERS:
            kc.kubectl(
                "rollout",
                "status",
                "-n",
                "kube-system",
                f"deploy/{deployment}",
                "--timeout=180s",
                timeout=200,
            )
        started = time.monotonic()
        # Which of kcm and kubeloop writes first is a race: a claim kubeloop's controller won
        # entirely leaves it nothing of kcm's to see. Claims come until each has seen kcm.
        lines = {
            d: f'kubeloop_kcm_counterpart_active{{controller="{c}"}} 1.0'
            for d, c in KUBELOOP_CONTROLLERS.items()
        }
        canaries: list[str] = []
        for i in range(CANARIES):
            canaries.append(f"first-{i}")
            grown_claim(kc, ns, canaries[-1], "96Mi")
            if all(reports(kc, d, line) for d, line in lines.items()):
                break
        for deployment, kcm_controller in KUBELOOP_CONTROLLERS.items():
            eventually(
                f"{deployment} to report kcm's {kcm_controller}",
                partial(reports, kc, deployment, lines[deployment]),
                120,
                0.5,
            )
            logs = kc.kubectl("logs", "-n", "kube-system", f"deploy/{deployment}")
            assert "standing down" in logs and f"--controllers=*,-{kcm_controller}" in logs, logs[-2000:]
        took = time.monotonic() - started

        def warned() -> set[str]:
            events = kc.get("events", "-A", "--field-selector", "reason=KubeControllerManagerActive")["items"]
            return {e["source"].get("component", "") for e in events if e["type"] == "Warning"}

        components = eventually(
            "three Warnings KubeControllerManagerActive",
            warned,
            120,
            0.5,
            satisfied=lambda found: len(found) >= 3,
        )
        assert len(components) == 3, components
        raced = [w for c in canaries for w in kubeloop_writes(kc, ns, c)]
        print(f"stood down {took:.1f} s after the first of {len(canaries)} claims; their writes: {raced}")
        grown_claim(kc, ns, "second", "96Mi")
        assert kubeloop_writes(kc, ns, "second") == []
    finally:
        helm(kc, "upgrade", kind.HELM_RELEASE, str(kind.HELM_CHART), *values, "--wait", "--timeout=5m")
    left = kc.kubectl("get", "deployments", "-n", "kube-system", "-o", "name").split()
    assert not [w for w in left if w.split("/", 1)[1] in KUBELOOP_CONTROLLERS], left
