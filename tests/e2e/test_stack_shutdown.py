"""`make up` stopped while a pod uses a volume (issue 29, hole 8): Ctrl-C / SIGTERM must leave no
mount or loop device behind, and the next start must mount the pod's volume again, its data intact.
A launcher killed with SIGKILL cannot clean up: its volumes stay mounted until the next start takes
them over (mounted once, not twice), and that start's stop unmounts them.

The same stop whatever became of the console (issue 44, part 1): Ctrl-C after the `tee` of
`make up 2>&1 | tee` has gone, the terminal closed (a hang-up), and `make down` from elsewhere.

Runs the real launcher (`python -m localstack.main up`); the pod and its claim live in etcd, which
the home keeps across runs."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import termios
import threading
from collections.abc import Callable
from pathlib import Path

import psutil

from controller_runtime.toolchain import REPO_ROOT
from localstack.leftovers import find_leftovers, force_cleanup, loop_devices_under, mounts_under
from tests.support.waits import consistently, eventually, no_problems

from .stacks import RunningStack, Spawn, cleanup, launch, short_home, stack_processes, to_files

NODE = "node-a"
DATA = "written before the stop"


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
    eventually("pod app Running", lambda: _pod_phase(stack) == "Running", 90, 0.3, context=stack.output)
    uid = stack.kubectl_run("get", "pod", "app", "-o", "jsonpath={.metadata.uid}")
    pv = stack.kubectl_run("get", "pvc", "data", "-o", "jsonpath={.spec.volumeName}")
    kubelet = stack.home / "nodes" / NODE / "kubelet"
    return kubelet / "pods" / uid / "volumes" / "kubernetes.io~csi" / pv / "mount"


def _pod_phase(stack: RunningStack) -> str:
    return stack.kubectl_run("get", "pod", "app", "-o", "jsonpath={.status.phase}", check=False)


def _mounted(path: Path) -> int:
    """How many mounts are stacked on `path` (a volume taken over after a crash must be one)."""
    return sum(1 for p in mounts_under(path.parent) if p == str(path))


def _stopped(stack: RunningStack) -> None:
    """The launcher has exited 0 after its stop, and none of its processes is left."""
    code = stack.proc.wait(120)
    assert code == 0, stack.output()
    _gone, alive = psutil.wait_procs(stack.children, timeout=10)
    assert not alive and stack_processes(stack.home) == [], f"left running: {alive}"


def _sigterm(stack: RunningStack) -> None:
    stack.proc.send_signal(signal.SIGTERM)
    _stopped(stack)


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


def _launch_run(home: Path, tmp_path: Path, run: str, spawn: Spawn = to_files) -> RunningStack:
    base = tmp_path / run
    base.mkdir()
    return launch(home, base, spawn=spawn)


def _stop_and_start_again(home: Path, tmp_path: Path) -> None:
    first = _launch_run(home, tmp_path, "1")
    try:
        mount = _create_pod_with_claim(first, tmp_path / "1")
        eventually(f"{mount} mounted", lambda: _mounted(mount) == 1, 90, 0.3, context=first.output)
        (mount / "data.txt").write_text(DATA)
        assert loop_devices_under(home), "the volume's loop device is attached"
        _sigterm(first)
        _assert_nothing_left(first)
    finally:
        cleanup(first)

    # The pod is still in etcd: the node agent stages and publishes its volume again.
    second = _launch_run(home, tmp_path, "2")
    try:
        eventually(f"{mount} mounted again", lambda: _mounted(mount) == 1, 90, 0.3, context=second.output)
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
        cleanup(second)

    # The next start takes the volume over as it is (mounted once, one loop device), and its stop
    # unmounts it.
    third = _launch_run(home, tmp_path, "3")
    try:

        def taken_over() -> list[str]:
            mounts, devices = mounts_under(home), loop_devices_under(home)
            problems = [f"mounted {_mounted(mount)} times: {mounts}"] if _mounted(mount) != 1 else []
            return problems + ([f"loop devices {devices}"] if len(devices) != 1 else [])

        # A few reconcile passes of the node agent, which is ready already: mounted once, one device.
        consistently("the volume taken over as it is", taken_over, 2, 0.2, satisfied=no_problems)
        assert (mount / "data.txt").read_text() == DATA
        _sigterm(third)
        _assert_nothing_left(third)
    finally:
        cleanup(third)


class _Console:
    """The launcher's stdout and stderr on one console, which a thread copies into stdout.txt (what
    the person sees) until close() takes the console away."""

    def __init__(self) -> None:
        self._fd = -1
        self._closing = threading.Event()
        self._copier: threading.Thread | None = None

    def _follow(self, fd: int, stdout: Path, stderr: Path) -> None:
        self._fd = fd
        stdout.write_bytes(b"")
        stderr.write_bytes(b"")  # stderr is on the same console, so in stdout.txt
        self._copier = threading.Thread(target=self._copy, args=(stdout,), daemon=True)
        self._copier.start()

    def _copy(self, into: Path) -> None:
        with into.open("ab") as out:
            while not self._closing.is_set():
                if not select.select([self._fd], [], [], 0.2)[0]:
                    continue
                try:
                    data = os.read(self._fd, 65536)
                except OSError:  # EIO: nothing has the terminal open any more
                    return
                if not data:
                    return
                out.write(data)
                out.flush()

    def close(self) -> None:
        self._closing.set()
        if self._copier is not None:
            self._copier.join(10)
        os.close(self._fd)


class PipeConsole(_Console):
    """`make up 2>&1 | tee stdout.txt`; close() is `tee` ending with the Ctrl-C that reaches it too."""

    def spawn(
        self, argv: list[str], env: dict[str, str], stdout: Path, stderr: Path
    ) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        assert proc.stdout is not None
        self._follow(os.dup(proc.stdout.fileno()), stdout, stderr)
        proc.stdout.close()
        return proc


def _take_the_terminal() -> None:
    """In the child, after setsid: its pty becomes the session's controlling terminal, and SIGHUP is
    at its default, as under a login shell."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


class TerminalConsole(_Console):
    """`make up` in a terminal: the launcher leads a session on a pty. close() is the terminal going
    away (an ssh session dropped, a tmux window killed): the master's last close hangs the pty up,
    and the kernel sends SIGHUP to the session's leader; the launcher's writes fail with EIO."""

    def spawn(
        self, argv: list[str], env: dict[str, str], stdout: Path, stderr: Path
    ) -> subprocess.Popen[bytes]:
        master, pty = os.openpty()
        try:
            proc = subprocess.Popen(
                argv, cwd=REPO_ROOT, env=env, stdin=pty, stdout=pty, stderr=pty,
                start_new_session=True, preexec_fn=_take_the_terminal,
            )  # fmt: skip
        finally:
            os.close(pty)
        self._follow(master, stdout, stderr)
        return proc


def _stop_with_a_mounted_volume(
    home: Path, tmp_path: Path, stop: Callable[[RunningStack], None], spawn: Spawn = to_files
) -> RunningStack:
    """A stack with a pod's volume mounted (two mounts, a loop device), stopped by `stop`: the
    launcher exits 0 and nothing of it is left."""
    stack = _launch_run(home, tmp_path, "1", spawn)
    try:
        mount = _create_pod_with_claim(stack, tmp_path / "1")
        eventually(f"{mount} mounted", lambda: _mounted(mount) == 1, 90, 0.3, context=stack.output)
        assert loop_devices_under(home), "the volume's loop device is attached"
        stop(stack)
        _stopped(stack)
        _assert_nothing_left(stack)
    finally:
        cleanup(stack)
    return stack


def _stack_log(stack: RunningStack) -> str:
    return (stack.home / "logs" / "stack.log").read_text()


def _lost_console_kept_in_the_log(stack: RunningStack) -> None:
    log = _stack_log(stack)
    assert "fatal error" not in log, log[-4000:]
    assert "is gone" in log and "kubeloop: stopped" in log, "the console's last lines are in the log"


def test_ctrl_c_after_the_console_pipe_closed_stops_in_order(tmp_path: Path) -> None:
    """`make up 2>&1 | tee up.log`, then Ctrl-C: tee ends first, the launcher's writes get EPIPE."""
    console = PipeConsole()

    def ctrl_c(stack: RunningStack) -> None:
        console.close()
        stack.proc.send_signal(signal.SIGINT)

    with short_home() as home:
        try:
            stack = _stop_with_a_mounted_volume(home, tmp_path, ctrl_c, console.spawn)
            _lost_console_kept_in_the_log(stack)
        finally:
            force_cleanup(home)


def test_terminal_hang_up_stops_in_order(tmp_path: Path) -> None:
    """`make up` in a terminal that is closed: SIGHUP, then EIO on every write to the console."""
    console = TerminalConsole()

    def hang_up(stack: RunningStack) -> None:
        console.close()

    with short_home() as home:
        try:
            stack = _stop_with_a_mounted_volume(home, tmp_path, hang_up, console.spawn)
            _lost_console_kept_in_the_log(stack)
            assert 'msg="shutting down" signal=SIGHUP' in _stack_log(stack)
        finally:
            force_cleanup(home)


def _down(home: Path) -> subprocess.CompletedProcess[str]:
    """`make down` for the stack on `home`, from another process."""
    return subprocess.run(
        [sys.executable, "-m", "localstack.main", "down"],
        cwd=REPO_ROOT, env={**os.environ, "KUBELOOP_HOME": str(home)}, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip


def test_down_stops_the_running_stack_in_order(tmp_path: Path) -> None:
    def down(stack: RunningStack) -> None:
        res = _down(stack.home)
        assert res.returncode == 0, f"{res.stdout}{res.stderr}\n{stack.output()}"
        assert f"stopping the stack in {stack.home} (pid {stack.proc.pid})" in res.stdout, res.stdout
        assert res.stdout.rstrip().endswith("kubeloop: stopped"), res.stdout
        assert stack.proc.poll() is not None, "down returns once the launcher has exited"

    with short_home() as home:
        try:
            _stop_with_a_mounted_volume(home, tmp_path, down)
            again = _down(home)
            assert again.returncode == 0 and again.stderr == "", again
            assert again.stdout == f"kubeloop: no stack is running in {home}\n"
        finally:
            force_cleanup(home)
