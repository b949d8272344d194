"""`make up` stopped while a pod uses a volume (issue 29, hole 8): Ctrl-C / SIGTERM must leave no
mount or loop device behind, and the next start must mount the pod's volume again, its data intact.
A launcher killed with SIGKILL cannot clean up: its volumes stay mounted until the next start takes
them over (mounted once, not twice), and that start's stop unmounts them.

Runs the real launcher (`python -m localstack.main up`) on one home three times; the pod and its
claim live in etcd, which the home keeps across runs."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from localstack.leftovers import find_leftovers, force_cleanup, loop_devices_under, mounts_under

from .test_stack import RunningStack, _cleanup, _launch, _stack_processes, short_home

NODE = "node-a"
DATA = "written before the stop"


def _eventually(check: Callable[[], bool], what: str, stack: RunningStack, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{stack.output()}")
        time.sleep(0.3)


def _create_pod_with_claim(stack: RunningStack, base: Path) -> Path:
    """A claim of the default class and a pod on node-a using it, as in the README; returns the
    pod's mount path once the pod runs."""
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data", "namespace": "default"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "64Mi"}}},
    }
    mount = {"name": "data", "mountPath": "/data"}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "app", "namespace": "default"},
        "spec": {
            "nodeName": NODE,
            "containers": [{"name": "app", "image": "busybox", "volumeMounts": [mount]}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
        },
    }
    manifest = base / "app.json"
    manifest.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [claim, pod]}))
    stack.kubectl_run("create", "-f", str(manifest))
    _eventually(lambda: _pod_phase(stack) == "Running", "pod app Running", stack)
    uid = stack.kubectl_run("get", "pod", "app", "-o", "jsonpath={.metadata.uid}")
    pv = stack.kubectl_run("get", "pvc", "data", "-o", "jsonpath={.spec.volumeName}")
    kubelet = stack.home / "nodes" / NODE / "kubelet"
    return kubelet / "pods" / uid / "volumes" / "kubernetes.io~csi" / pv / "mount"


def _pod_phase(stack: RunningStack) -> str:
    return stack.kubectl_run("get", "pod", "app", "-o", "jsonpath={.status.phase}", check=False)


def _mounted(path: Path) -> int:
    """How many mounts are stacked on `path` (a volume taken over after a crash must be one)."""
    return sum(1 for p in mounts_under(path.parent) if p == str(path))


def _sigterm(stack: RunningStack) -> None:
    stack.proc.send_signal(signal.SIGTERM)
    code = stack.proc.wait(120)
    assert code == 0, stack.output()
    _gone, alive = psutil.wait_procs(stack.children, timeout=10)
    assert not alive and _stack_processes(stack.home) == [], f"left running: {alive}"


def _assert_nothing_left(stack: RunningStack) -> None:
    left = find_leftovers(stack.home)
    assert not left.mounts, f"mounts left after the stop: {left.mounts}\n{stack.output()}"
    assert not left.loop_devices, f"loop devices left after the stop: {left.loop_devices}"
    assert "left behind" not in stack.stderr.read_text()


def test_stop_with_a_mounted_volume_leaves_nothing_and_next_start_mounts_again(tmp_path: Path) -> None:
    with short_home() as home:
        try:
            _stop_and_start_again(home, tmp_path)
        finally:
            # A failed run must not leave this home's mounts and loop devices on the machine, nor
            # have short_home delete a mounted volume's files.
            force_cleanup(home)


def _launch_run(home: Path, tmp_path: Path, run: str) -> RunningStack:
    base = tmp_path / run
    base.mkdir()
    return _launch(home, base)


def _stop_and_start_again(home: Path, tmp_path: Path) -> None:
    first = _launch_run(home, tmp_path, "1")
    try:
        mount = _create_pod_with_claim(first, tmp_path / "1")
        _eventually(lambda: _mounted(mount) == 1, f"{mount} mounted", first)
        (mount / "data.txt").write_text(DATA)
        assert loop_devices_under(home), "the volume's loop device is attached"
        _sigterm(first)
        _assert_nothing_left(first)
    finally:
        _cleanup(first)

    # The pod is still in etcd: the node agent stages and publishes its volume again.
    second = _launch_run(home, tmp_path, "2")
    try:
        _eventually(lambda: _mounted(mount) == 1, f"{mount} mounted again", second)
        assert (mount / "data.txt").read_text() == DATA
        assert _pod_phase(second) == "Running"
        # SIGKILL: the launcher's children die with it (parent-death signal), no agent unmounts.
        second.proc.kill()
        second.proc.wait(10)
        _gone, alive = psutil.wait_procs(second.children, timeout=10)
        assert not alive, f"orphaned after SIGKILL: {alive}"
        assert _mounted(mount) == 1 and len(loop_devices_under(home)) == 1, (
            "what docs/local-stack.md says stays"
        )
    finally:
        _cleanup(second)

    # The next start takes the volume over as it is (mounted once, one loop device), and its stop
    # unmounts it.
    third = _launch_run(home, tmp_path, "3")
    try:
        time.sleep(2)  # a few reconcile passes of the node agent, which is ready already
        assert _mounted(mount) == 1, mounts_under(home)
        assert len(loop_devices_under(home)) == 1, loop_devices_under(home)
        assert (mount / "data.txt").read_text() == DATA
        _sigterm(third)
        _assert_nothing_left(third)
    finally:
        _cleanup(third)
