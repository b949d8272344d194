"""`kubectl kubeloop` on the real stack: a healthy claim's description lists every step with its
duration, and each stuck case names the component that waits and why: no PV and nothing to
provision from, provisioning failing, Multi-Attach of a RWO volume, a node that does not report, a
node-side stage failure, an expansion waiting for the node, a VolumeAttributesClass that does not
exist. `get volumes` puts each volume on a line with what its node measures."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controller_runtime.client import ApiClient
from controller_runtime.resources import NODES, PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, STORAGE_CLASSES
from controller_runtime.toolchain import REPO_ROOT
from csi_driver import DRIVER_NAME
from localstack.controlplane import ControlPlane
from localstack.storage_stack import STORAGE_COMPONENTS, StorageStack
from tests.support.waits import eventually_async

pytestmark = [pytest.mark.integration, pytest.mark.root]
COMPONENTS = (*STORAGE_COMPONENTS, "external-provisioner", "external-resizer", "volume-expand-controller")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(control_plane: ControlPlane, api: ApiClient) -> AsyncIterator[StorageStack]:
    s = StorageStack(control_plane, api, COMPONENTS)
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


async def plugin(stack: StorageStack, *args: str) -> tuple[int, str, str]:
    """`kubectl kubeloop ARGS` as a user runs it: the real kubectl finds kubectl-kubeloop on PATH."""
    # kubectl hands a plugin no flags of its own: the plugin reads $KUBECONFIG, as kubectl does.
    env = {
        **os.environ,
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}",
        "KUBECONFIG": str(stack.cp.admin_kubeconfig),
    }
    proc = await asyncio.create_subprocess_exec(
        str(stack.cp.toolchain.binary("kubectl")), "kubeloop", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    out, err = await proc.communicate()
    return int(proc.returncode or 0), out.decode(), err.decode()


async def described(stack: StorageStack, namespace: str, claim: str) -> dict[str, Any]:
    code, out, err = await plugin(
        stack,
        "describe",
        "pvc",
        claim,
        "-n",
        namespace,
        "-o",
        "json",
    )
    assert code == 0, err
    return dict(json.loads(out))


async def wait_waiting(
    stack: StorageStack, namespace: str, claim: str, component: str, words: str
) -> dict[str, Any]:
    """Describes until a wait of `component` mentions `words`; returns that description."""

    async def found() -> dict[str, Any] | None:
        report = await described(stack, namespace, claim)
        hit = [w for w in report["waiting"] if w["component"].startswith(component) and words in w["reason"]]
        return report if hit else None

    try:
        return dict(await eventually_async(f"{component} waiting: {words}", found, 60, 1))
    except AssertionError:
        raise AssertionError(json.dumps(await described(stack, namespace, claim), indent=1)) from None


def claim_body(
    name: str, class_name: str | None = "kubeloop", size: str = "64Mi", **spec: Any
) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": class_name,
            "resources": {"requests": {"storage": size}},
            **spec,
        },
    }


async def test_a_healthy_claim_lists_every_step_with_its_duration(
    stack: StorageStack, namespace: str
) -> None:
    await stack.api.create(PERSISTENT_VOLUME_CLAIMS, claim_body("data"), namespace)
    await stack.pod(namespace, "app", "node-a", "data")
    await stack.wait_running(namespace, "app")
    report = await described(stack, namespace, "data")
    assert report["stuck"] is False and report["waiting"] == [], report["waiting"]
    # kcm runs with its storage controllers off: kubeloop's never stand down, and nobody else binds.
    assert report["control_plane"] == [], report["control_plane"]
    steps = {s["name"]: s for s in report["steps"]}
    assert set(steps) == {"provision", "bind", "attach", "mount"}, steps
    for step in steps.values():
        assert step["ended"] and step["seconds"] is not None and 0 <= step["seconds"] < 60, step
    kinds = [link["kind"] for link in report["chain"]]
    assert kinds == ["PersistentVolumeClaim", "PersistentVolume", "VolumeAttachment", "Node", "Pod"]
    reasons = [e["reason"] for e in report["events"]]
    assert "ProvisioningSucceeded" in reasons and "SuccessfulAttachVolume" in reasons
    assert [e["time"] for e in report["events"]] == sorted(e["time"] for e in report["events"])
    # The text a person reads.
    code, text, _ = await plugin(stack, "describe", "pvc", "data", "-n", namespace)
    assert code == 0 and "Status:  ok" in text and "Timeline:" in text and "ProvisioningSucceeded" in text
    # Every volume on a line, with the bytes its node measured (the node agent's kubelet metrics).
    pv = report["chain"][1]["name"]

    async def measured() -> dict[str, Any] | None:
        _, out, _ = await plugin(stack, "get", "volumes", "-o", "json")
        row = next(r for r in json.loads(out) if r["volume"] == pv)
        return row if row["used_bytes"] is not None else None

    row = await eventually_async("the volume's used bytes in get volumes", measured, 40, 1)
    assert (
        row["claim"] == f"{namespace}/data" and row["attached"] == ["node-a"] and row["in_use"] == ["node-a"]
    )
    assert row["health"] == "ok" and row["driver"] == DRIVER_NAME
    code, table, _ = await plugin(stack, "get", "volumes")
    assert table.splitlines()[0].split()[:4] == ["VOLUME", "CLAIM", "STATUS", "SIZE"] and pv in table


async def test_no_matching_volume_and_nothing_to_provision_from(stack: StorageStack, namespace: str) -> None:
    await stack.api.create(PERSISTENT_VOLUME_CLAIMS, claim_body("orphan", class_name=""), namespace)
    await wait_waiting(stack, namespace, "orphan", "pv-controller", "names no class to provision from")


async def test_provisioning_that_fails_names_the_provisioner_and_its_error(
    stack: StorageStack, namespace: str, tmp_path: Path
) -> None:
    name = f"bad-{namespace}"
    await stack.api.create(
        STORAGE_CLASSES,
        {
            "metadata": {"name": name},
            "provisioner": DRIVER_NAME,
            "parameters": {"csi.storage.k8s.io/fstype": "ntfs"},
        },
    )
    try:
        await stack.api.create(PERSISTENT_VOLUME_CLAIMS, claim_body("c", class_name=name), namespace)
        report = await wait_waiting(stack, namespace, "c", "external-provisioner", "provisioning fails")
        assert "ntfs" in report["waiting"][0]["reason"]
        _, text, _ = await plugin(stack, "describe", "pvc", "c", "-n", namespace)
        # Beside a kubeconfig whose directory has the launcher's status.json (as `make up` writes
        # it), the plugin reads the components' /debug/queues: the provisioner is retrying the claim.
        home = tmp_path / "home"
        home.mkdir()
        shutil.copy(stack.cp.admin_kubeconfig, home / "kubeconfig")
        (home / "status.json").write_text(json.dumps({"components": stack.components.status()}))
        _, out, _ = await plugin(
            stack,
            f"--kubeconfig={home / 'kubeconfig'}",
            "describe",
            "pvc",
            "c",
            "-n",
            namespace,
            "-o",
            "json",
        )
        claim_uid = (await stack.api.get(PERSISTENT_VOLUME_CLAIMS, "c", namespace))["metadata"]["uid"]
        retried = [r for r in json.loads(out)["retries"] if r["key"] == claim_uid]  # its queue's key
        assert retried and retried[0]["component"] == "external-provisioner"
        # The last error is CreateVolume's or, once the claim has been retried, upstream's message
        # for a claim whose infeasible request is not sent again before --retry-interval-max.
        last = retried[0]["error"]
        assert "ntfs" in last or "previously failed with infeasible error" in last, last
        assert retried[0]["retries"] >= 1 and retried[0]["next_retry_in"] >= 0
        assert (
            "Status:  STUCK" in text and f"external-provisioner ({DRIVER_NAME}): provisioning fails" in text
        )
    finally:
        await stack.api.delete(STORAGE_CLASSES, name)


async def test_multi_attach_names_the_node_and_pod_holding_the_volume(
    stack: StorageStack, namespace: str
) -> None:
    pvc, _, _ = await stack.volume(namespace)
    await stack.pod(namespace, "first", "node-a", pvc)
    await stack.wait_running(namespace, "first")
    await stack.pod(namespace, "second", "node-b", pvc)
    report = await wait_waiting(stack, namespace, pvc, "attach-detach controller", "attached to node-a")
    reason = next(w["reason"] for w in report["waiting"] if w["component"] == "attach-detach controller")
    assert "still in use there by pod first" in reason and "node-b" in reason


async def test_a_node_that_does_not_report(stack: StorageStack, namespace: str) -> None:
    node = f"ghost-{namespace}"
    await stack.api.create(NODES, {"metadata": {"name": node}})
    try:
        pvc, _, _ = await stack.volume(namespace)
        await stack.pod(namespace, "lost", node, pvc)
        report = await wait_waiting(stack, namespace, pvc, f"kubelet on {node}", "does not report")
        assert "never reported Ready" in report["waiting"][0]["reason"]
    finally:
        await stack.api.delete(NODES, node)


async def test_a_node_side_stage_failure_names_the_kubelet_and_its_error(
    stack: StorageStack, namespace: str
) -> None:
    pvc, pv, _ = await stack.volume(namespace)
    await stack.api.patch(PERSISTENT_VOLUMES, pv, {"spec": {"mountOptions": ["kubeloop-no-such-option"]}})
    await stack.pod(namespace, "broken", "node-a", pvc)
    report = await wait_waiting(stack, namespace, pvc, "kubelet on node-a", "mounting fails")
    assert "MountVolume" in report["waiting"][0]["reason"]


async def test_an_expansion_waiting_for_the_node(stack: StorageStack, namespace: str) -> None:
    await stack.api.create(PERSISTENT_VOLUME_CLAIMS, claim_body("grow"), namespace)

    async def bound() -> bool:
        c = await stack.api.get(PERSISTENT_VOLUME_CLAIMS, "grow", namespace)
        return (c.get("status") or {}).get("phase") == "Bound"

    await eventually_async("claim grow bound", bound, 60)
    await stack.api.patch(
        PERSISTENT_VOLUME_CLAIMS,
        "grow",
        {"spec": {"resources": {"requests": {"storage": "96Mi"}}}},
        namespace,
    )
    report = await wait_waiting(stack, namespace, "grow", "kubelet", "filesystem grows when a pod")
    assert any(s["name"] == "expand" and not s["ended"] for s in report["steps"]), report["steps"]


async def test_an_unknown_volume_attributes_class(stack: StorageStack, namespace: str) -> None:
    await stack.api.create(PERSISTENT_VOLUME_CLAIMS, claim_body("attrs"), namespace)

    async def bound() -> bool:
        c = await stack.api.get(PERSISTENT_VOLUME_CLAIMS, "attrs", namespace)
        return (c.get("status") or {}).get("phase") == "Bound"

    await eventually_async("claim attrs bound", bound, 60)
    await stack.api.patch(
        PERSISTENT_VOLUME_CLAIMS, "attrs", {"spec": {"volumeAttributesClassName": "no-such-class"}}, namespace
    )
    report = await wait_waiting(stack, namespace, "attrs", "external-resizer", "'no-such-class'")
    assert report["stuck"] is True


async def test_a_claim_that_does_not_exist_is_kubectls_not_found(stack: StorageStack, namespace: str) -> None:
    code, _, err = await plugin(stack, "describe", "pvc", "nothing-here", "-n", namespace)
    assert code == 1 and 'persistentvolumeclaims "nothing-here" not found' in err


async def test_watch_prints_the_story_again_when_it_changes(
    stack: StorageStack, namespace: str, tmp_path: Path
) -> None:
    await stack.api.create(PERSISTENT_VOLUME_CLAIMS, claim_body("later"), namespace)
    env = {**os.environ, "KUBECONFIG": str(stack.cp.admin_kubeconfig)}
    printed = tmp_path / "watch.txt"
    with printed.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kubectl_kubeloop.main", "describe", "pvc", "later", "-n", namespace,
            "--watch", "--interval=0.5", stdout=out, env=env, cwd=REPO_ROOT,
        )  # fmt: skip
    try:

        async def says(words: str) -> bool:
            return words in await asyncio.to_thread(printed.read_text)

        await eventually_async("the claim bound in a description", lambda: says("Phase:   Bound"), 60)
        await stack.pod(namespace, "consumer", "node-a", "later")
        await eventually_async(
            "a description with the pod running", lambda: says("Pod/consumer: Running, Ready"), 60
        )
        text = await asyncio.to_thread(printed.read_text)
        assert text.count("Claim:   ") >= 2 and "\n--- " in text
        assert proc.returncode is None, "--watch keeps following the claim"
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
