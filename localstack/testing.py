"""The pytest-facing helper: a throw-away control plane on free ports."""

from __future__ import annotations

from pathlib import Path

from .controlplane import KCM_CONTROLLERS, ControlPlane, Ports
from .proc import free_ports


def free_stack_ports() -> Ports:
    """Five distinct ports free right now. Another process could take one before the stack binds
    it; the control plane then fails naming the port, and a test run can simply be repeated."""
    etcd_client, etcd_peer, apiserver, kcm, scheduler = free_ports(5)
    return Ports(etcd_client, etcd_peer, apiserver, kcm, scheduler)


async def start_test_control_plane(
    tmp_dir: Path,
    with_kcm: bool = False,
    with_scheduler: bool = False,
    *,
    kcm_controllers: str = KCM_CONTROLLERS,
    startup_timeout: float = 120.0,
) -> ControlPlane:
    """Starts etcd (without fsync: test data is disposable) and kube-apiserver, plus kcm and the
    scheduler if asked, with `tmp_dir` as home and free ports; returns the running ControlPlane.
    The caller owns it and must `await cp.stop()`. Fails (MissingBinaryError) if the binaries were
    not built: run `make binaries`."""
    cp = ControlPlane(
        Path(tmp_dir),
        free_stack_ports(),
        with_kcm=with_kcm,
        with_scheduler=with_scheduler,
        kcm_controllers=kcm_controllers,
        etcd_unsafe_no_fsync=True,
        startup_timeout=startup_timeout,
        stop_timeout=10.0,
    )
    await cp.start()
    return cp
