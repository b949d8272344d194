"""`make up DRIVER=recipe` (issue 48): the whole local stack on a CSI driver that is not kubeloop's,
run from its driver-bench recipe: the buggy test driver of tests/driver_bench with no bug on, which
is small and shares no code with kubeloop's driver. A claim of the recipe's StorageClass is
provisioned, attached and mounted into its pod by the node agent through the recipe driver's node
plugin, `kubectl kubeloop describe` tells it bound and healthy, and the stop leaves nothing behind.
A recipe the stack cannot run is refused with its reason, and nothing stays running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller_runtime.mounts import read_mounts
from controller_runtime.toolchain import REPO_ROOT
from localstack.leftovers import find_leftovers
from localstack.recipe_stack import shared_dir
from localstack.testing import free_stack_ports
from tests.driver_bench.recipes import BUGGY, write_recipe
from tests.support.waits import eventually

from .stacks import RunningStack, cleanup, launch, launcher_argv, short_home, stack_processes, toolchain

pytestmark = [pytest.mark.integration, pytest.mark.root]

DRIVER = "buggy.csi.bench.kubeloop.dev"
CLASS = "buggy"  # the recipe's name: its StorageClass's, as storage_class.name is not given


def require_root() -> None:
    # Never skipped: the node plugins bind-mount volumes into the pods' directories.
    assert os.geteuid() == 0, "the driver recipe stack test needs root (mount)"


def manifests() -> str:
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data", "namespace": "default"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": CLASS,
            "resources": {"requests": {"storage": "1Mi"}},
        },
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "app", "namespace": "default"},
        "spec": {
            "containers": [
                {"name": "app", "image": "busybox", "volumeMounts": [{"name": "d", "mountPath": "/d"}]}
            ],
            "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}],
        },
    }
    return yaml.safe_dump_all([claim, pod])


def kubectl_json(stack: RunningStack, *args: str) -> dict[str, Any]:
    return dict(json.loads(stack.kubectl_run(*args, "-o", "json")))


def describe(stack: RunningStack, *args: str) -> subprocess.CompletedProcess[str]:
    """`kubectl kubeloop describe` as the plugin runs: it reads $KUBECONFIG, as kubectl does."""
    env = {**os.environ, "KUBECONFIG": str(stack.home / "kubeconfig")}
    return subprocess.run(
        [sys.executable, "-m", "kubectl_kubeloop.main", "describe", "pvc", "data", "-n", "default", *args],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60,
    )  # fmt: skip


def test_a_pod_mounts_its_claim_on_the_recipes_driver(tmp_path: Path) -> None:
    require_root()
    with short_home() as home:
        stack = launch(home, tmp_path, f"--driver-recipe={BUGGY}")
        try:
            out = stack.stdout.read_text()
            for name in ("csi-driver-controller", "csi-driver-node-node-a", "node-driver-registrar-node-b"):
                assert f"ok  {name}" in out, out
            # The CSIDriver and the class are the recipe's, under the name its plugins report.
            csidriver = kubectl_json(stack, "get", "csidriver", DRIVER)
            assert csidriver["spec"]["attachRequired"] is True, csidriver
            assert kubectl_json(stack, "get", "storageclass", CLASS)["provisioner"] == DRIVER
            assert "loop.csi.kubeloop.dev" not in stack.kubectl_run("get", "csidrivers")
            csinode = kubectl_json(stack, "get", "csinode", "node-a")
            assert [d["name"] for d in csinode["spec"]["drivers"]] == [DRIVER], csinode

            applied = subprocess.run(
                [str(stack.kubectl), f"--kubeconfig={home / 'kubeconfig'}", "apply", "-f", "-"],
                input=manifests(), capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert applied.returncode == 0, applied.stderr

            def running() -> dict[str, Any] | None:
                pod = kubectl_json(stack, "get", "pod", "app", "-n", "default")
                return pod if pod["status"].get("phase") == "Running" else None

            pod = eventually("the pod Running", running, 90, 0.5, context=stack.output)
            node, uid = pod["spec"]["nodeName"], pod["metadata"]["uid"]
            pv = kubectl_json(stack, "get", "pvc", "data", "-n", "default")["spec"]["volumeName"]
            handle = kubectl_json(stack, "get", "pv", pv)["spec"]["csi"]["volumeHandle"]
            # The node agent had the recipe driver's node plugin bind its volume into the pod's
            # directory: a file written there is in the driver's backend (a directory per volume).
            target = (
                home
                / "nodes"
                / node
                / "kubelet"
                / "pods"
                / uid
                / "volumes"
                / "kubernetes.io~csi"
                / pv
                / "mount"
            )
            assert str(target) in {m.mountpoint for m in read_mounts()}, f"{target} is not mounted"
            (target / "hello").write_text("from the pod")
            assert (shared_dir(home) / "volumes" / handle / "hello").read_text() == "from the pod"

            described = describe(stack, "-o", "json")
            assert described.returncode == 0, described.stderr
            report = json.loads(described.stdout)
            assert report["stuck"] is False and report["waiting"] == [], report
            kinds = [link["kind"] for link in report["chain"]]
            assert kinds == ["PersistentVolumeClaim", "PersistentVolume", "VolumeAttachment", "Node", "Pod"]
            steps = {s["name"]: s for s in report["steps"]}
            assert steps["bind"]["ended"] and steps["mount"]["ended"], steps
            text = describe(stack)
            assert text.returncode == 0 and "Status:  ok" in text.stdout, text.stdout + text.stderr

            # The stop: the node agents unmount through the recipe's plugins, nothing stays.
            stack.proc.send_signal(signal.SIGTERM)
            assert stack.proc.wait(90) == 0, stack.output()
            left = find_leftovers(home)
            assert not left.mounts and not left.loop_devices, left
            assert stack_processes(home) == [], stack_processes(home)
        finally:
            cleanup(stack)


def up(home: Path, recipe: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The launcher on `recipe` to its end (it is meant to fail): its exit status and console."""
    toolchain()  # a missing binary fails here, with how to build it
    env = {**os.environ, "KUBELOOP_HOME": str(home)}
    argv = launcher_argv(free_stack_ports(), f"--driver-recipe={recipe}", *extra)
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=180)


def test_a_recipe_with_an_unknown_field_is_refused_before_anything_starts(tmp_path: Path) -> None:
    doc = yaml.safe_load(BUGGY.read_text())
    doc["storage"] = {"class": "x"}
    with short_home() as home:
        done = up(home, write_recipe(tmp_path / "bad.yaml", doc))
        assert done.returncode == 2, done.stdout + done.stderr
        assert "storage: unknown field" in done.stderr, done.stderr
        assert not (home / "etcd").exists() and stack_processes(home) == []


def test_a_driver_that_never_becomes_ready_stops_the_stack(tmp_path: Path) -> None:
    require_root()
    doc = yaml.safe_load(BUGGY.read_text())
    doc["controller"]["command"] = ["sleep", "600"]
    doc["ready"] = {"timeout_seconds": 2}
    with short_home() as home:
        done = up(home, write_recipe(tmp_path / "never.yaml", doc))
        assert done.returncode == 1, done.stdout + done.stderr
        assert "the controller command as csi-driver-controller" in done.stderr, done.stderr
        assert "never became ready within 2s" in done.stderr, done.stderr
        # The control plane it had started is stopped again, the driver's command with it.
        assert "kubeloop: stopped" in done.stdout, done.stdout
        assert stack_processes(home) == [], stack_processes(home)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        # Two commands: node-local runs one instance per node serving every service.
        (
            {"node": {"command": ["{python}", "-m", "x"]}},
            "a recipe with a node.command runs with shared pools",
        ),
        # An attached volume needs an external-attacher, which no node runs.
        ({}, "csi_driver.attachRequired must be false with --pools node-local"),
    ],
)
def test_a_recipe_node_local_pools_cannot_run_is_refused_saying_why(
    tmp_path: Path, change: dict[str, Any], says: str
) -> None:
    doc = {**yaml.safe_load(BUGGY.read_text()), **change}
    with short_home() as home:
        done = up(home, write_recipe(tmp_path / "r.yaml", doc), "--pools=node-local")
        assert done.returncode == 2, done.stdout + done.stderr
        assert says in done.stderr, done.stderr
        assert not (home / "etcd").exists() and stack_processes(home) == []
