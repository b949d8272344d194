"""The real Kubernetes control plane as local processes: etcd, kube-apiserver, and optionally
kube-controller-manager (its own storage controllers off) and kube-scheduler, all on 127.0.0.1.

Layout of a stack's home directory (`$KUBELOOP_HOME`, default `.kubeloop/` in the checkout):

    kubeconfig            the admin kubeconfig (embedded credentials)
    kubeconfigs/          one kubeconfig per other identity (kcm, scheduler, kubeloop components)
    pki/                  CA, serving certificates, client certificates, service-account keys
    etcd/                 etcd's data directory (kept across runs, like a real cluster's)
    logs/<name>.log       each process's output; the previous run's is kept as <name>.previous.log
    stack.lock            held while a stack runs on this home, so two never share etcd's data
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from controller_runtime.certs import Identity
from controller_runtime.logs import get_logger
from controller_runtime.toolchain import REPO_ROOT, Toolchain

from . import certs
from .proc import ManagedProcess, UnhealthyError, check_ports_free, client_ssl_context, tail, wait_healthy

log = get_logger("stack")

SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"

# kube-controller-manager runs everything except the storage controllers kubeloop replaces, so
# garbage collection, namespace deletion, pv/pvc-protection and service-account tokens still work.
KCM_CONTROLLERS = (
    "*,-persistentvolume-binder-controller,-persistentvolume-attach-detach-controller,"
    "-persistentvolume-expander-controller"
)


def default_home() -> Path:
    """`$KUBELOOP_HOME`, or `.kubeloop/` in the checkout (docs/local-stack.md)."""
    env = os.environ.get("KUBELOOP_HOME")
    return Path(env).resolve() if env else REPO_ROOT / ".kubeloop"


@dataclass(frozen=True)
class Ports:
    """Loopback ports of the control plane. The defaults stay clear of a kind cluster's published
    ports and of a system etcd on 2379/2380."""

    etcd_client: int = 12379
    etcd_peer: int = 12380
    apiserver: int = 6443
    kube_controller_manager: int = 10257
    kube_scheduler: int = 10259

    def described(self, with_kcm: bool = True, with_scheduler: bool = True) -> dict[str, int]:
        """Port by human-readable purpose, for the port check's messages."""
        out = {
            "etcd client (--etcd-port)": self.etcd_client,
            "etcd peer (--etcd-peer-port)": self.etcd_peer,
            "kube-apiserver (--apiserver-port)": self.apiserver,
        }
        if with_kcm:
            out["kube-controller-manager (--kcm-port)"] = self.kube_controller_manager
        if with_scheduler:
            out["kube-scheduler (--scheduler-port)"] = self.kube_scheduler
        return out


class StackLockedError(RuntimeError):
    pass


StatusCallback = Callable[[str, float], None]
"""Called with (component, seconds it took) when a component becomes healthy."""

UnexpectedExitCallback = Callable[[ManagedProcess, int], None]


class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager, kube-scheduler) under one home directory.

    Use `async with ControlPlane(...) as cp:` or call `start()`/`stop()`. `stop()` is safe to call
    after a failed or partial `start()`.
    """

    def __init__(
        self,
        home: Path,
        ports: Ports | None = None,
        *,
        with_kcm: bool = True,
        with_scheduler: bool = True,
        kcm_controllers: str = KCM_CONTROLLERS,
        etcd_unsafe_no_fsync: bool = False,
        toolchain: Toolchain | None = None,
        extra_identities: Sequence[Identity] = (),
        startup_timeout: float = 90.0,
        stop_timeout: float = 15.0,
        on_status: StatusCallback | None = None,
        on_unexpected_exit: UnexpectedExitCallback | None = None,
    ) -> None:
        self.home = Path(home).resolve()
        self.ports = ports or Ports()
        self.with_kcm = with_kcm
        self.with_scheduler = with_scheduler
        # `*` runs kcm's own storage controllers too: the Go side of tests/conformance.
        self.kcm_controllers = kcm_controllers
        self.etcd_unsafe_no_fsync = etcd_unsafe_no_fsync
        self.toolchain = toolchain or Toolchain.default()
        self.extra_identities = tuple(extra_identities)
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._on_status = on_status
        self._on_unexpected_exit = on_unexpected_exit or log_unexpected_exit
        self.processes: dict[str, ManagedProcess] = {}
        self.startup_seconds: dict[str, float] = {}
        self._certs: certs.StackCerts | None = None
        self._lock_file: IO[str] | None = None

    # --- paths and addresses --------------------------------------------------------------------

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports.apiserver}"

    @property
    def etcd_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports.etcd_client}"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.home / "kubeconfig"

    @property
    def pki_dir(self) -> Path:
        return self.home / "pki"

    @property
    def kubeconfig_dir(self) -> Path:
        return self.home / "kubeconfigs"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def etcd_data_dir(self) -> Path:
        return self.home / "etcd"

    @property
    def ca_file(self) -> Path:
        return self.pki_dir / "ca.crt"

    @property
    def certs(self) -> certs.StackCerts:
        if self._certs is None:
            self._certs = certs.ensure_stack_certs(
                self.pki_dir,
                self.server,
                self.kubeconfig_dir,
                admin_kubeconfig=self.admin_kubeconfig,
                extra_identities=self.extra_identities,
            )
        return self._certs

    def log_path(self, name: str) -> Path:
        return self.logs_dir / f"{name}.log"

    def kubeconfig_for(self, identity: Identity) -> Path:
        """The kubeconfig of `identity` (created with its client certificate on first use)."""
        stack_certs = self.certs  # the admin kubeconfig is written with the rest on first access
        if identity == certs.ADMIN:
            return self.admin_kubeconfig
        return stack_certs.pki.write_kubeconfig(
            identity, self.server, self.kubeconfig_dir / f"{identity.file_stem}.kubeconfig"
        )

    def write_identity_kubeconfig(self, user: str, groups: Sequence[str] = ()) -> Path:
        """A kubeconfig authenticating as `user` in `groups` by client certificate. The identity gets
        only what RBAC grants it, so tests and components can run with least privilege."""
        return self.kubeconfig_for(Identity(user, tuple(groups)))

    # --- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> ControlPlane:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def check_ports(self) -> None:
        """Raises proc.PortInUseError naming the port and the component if one is taken."""
        check_ports_free(self.ports.described(self.with_kcm, self.with_scheduler))

    async def start(self) -> None:
        # Resolve every binary first: a missing one fails before anything runs.
        binaries = {
            "etcd": self.toolchain.binary("etcd"),
            "kube-apiserver": self.toolchain.binary("kube-apiserver"),
        }
        if self.with_kcm:
            binaries["kube-controller-manager"] = self.toolchain.binary("kube-controller-manager")
        if self.with_scheduler:
            binaries["kube-scheduler"] = self.toolchain.binary("kube-scheduler")
        self.home.mkdir(parents=True, exist_ok=True)
        self._acquire_lock()
        try:
            self.check_ports()
            self.logs_dir.mkdir(parents=True, exist_ok=True)
            for name in binaries:
                _rotate(self.log_path(name))
            _ = self.certs  # generate before the first process needs them
            await self._start_etcd()
            await self._start_apiserver()
            waits = []
            if self.with_kcm:
                waits.append(self._start_kcm())
            if self.with_scheduler:
                waits.append(self._start_scheduler())
            await asyncio.gather(*waits)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stops in reverse start order; every process group gets SIGTERM then SIGKILL."""
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            proc = self.processes.get(name)
            if proc is None:
                continue
            started = time.monotonic()
            code = await proc.stop(self.stop_timeout)
            log.info("stopped", component=name, exit_code=code, took=f"{time.monotonic() - started:.1f}s")
        self.processes.clear()
        self._release_lock()

    async def restart_apiserver(self) -> float:
        """Stops and starts kube-apiserver (etcd keeps the data); returns the seconds until ready.

        kube-controller-manager exits when the apiserver vanishes while it is still starting its
        controllers (its /healthz answers before that is done); in a cluster the kubelet would
        restart it. Here this does the same for kcm and the scheduler once the apiserver is back.
        """
        proc = self.processes.get("kube-apiserver")
        if proc is not None:
            await proc.stop(self.stop_timeout)
        seconds = await self._start_apiserver()
        await self._revive_dependents()
        return seconds

    async def restart_etcd(self) -> float:
        """Stops and starts etcd on its data directory, as a crashed or upgraded etcd member comes
        back; returns the seconds until healthy. The apiserver reconnects by itself; kcm and the
        scheduler are started again if they gave up meanwhile."""
        proc = self.processes.get("etcd")
        if proc is not None:
            await proc.stop(self.stop_timeout)
        seconds = await self._start_etcd()
        await self._revive_dependents()
        return seconds

    async def _revive_dependents(self) -> None:
        restarts = []
        for name, start in (
            ("kube-controller-manager", self._start_kcm),
            ("kube-scheduler", self._start_scheduler),
        ):
            dead = self.processes.get(name)
            if dead is not None and not dead.running:
                log.warning("restarting after the apiserver came back", component=name)
                restarts.append(start())
        await asyncio.gather(*restarts)

    # --- components -----------------------------------------------------------------------------

    def _new_process(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(
            name=name, argv=argv, log_path=self.log_path(name), on_unexpected_exit=self._on_unexpected_exit
        )
        self.processes[name] = proc
        return proc

    async def _healthy(self, proc: ManagedProcess, url: str, ssl_ctx: ssl.SSLContext | None = None) -> float:
        seconds = await wait_healthy(proc, url, ssl_context=ssl_ctx, timeout=self.startup_timeout)
        self.startup_seconds[proc.name] = seconds
        log.info("healthy", component=proc.name, took=f"{seconds:.2f}s", pid=proc.pid, log=str(proc.log_path))
        if self._on_status is not None:
            self._on_status(proc.name, seconds)
        return seconds

    async def _start_etcd(self) -> float:
        self.etcd_data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.etcd_data_dir, 0o700)
        peer = f"http://127.0.0.1:{self.ports.etcd_peer}"
        argv = [
            str(self.toolchain.binary("etcd")),
            "--name=kubeloop",
            f"--data-dir={self.etcd_data_dir}",
            f"--listen-client-urls={self.etcd_endpoint}",
            f"--advertise-client-urls={self.etcd_endpoint}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=kubeloop={peer}",
            "--initial-cluster-state=new",
            # Plain HTTP is acceptable only because etcd listens on loopback and the apiserver is its
            # one client; a shared host would want client TLS here.
            "--log-level=warn",
        ]
        if self.etcd_unsafe_no_fsync:
            # Tests throw the data away; skipping fsync makes every write several times faster.
            argv.append("--unsafe-no-fsync")
        proc = self._new_process("etcd", argv)
        await proc.start()
        return await self._healthy(proc, f"{self.etcd_endpoint}/health")

    def _apiserver_argv(self) -> list[str]:
        c = self.certs
        return [
            str(self.toolchain.binary("kube-apiserver")),
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports.apiserver}",
            # The serving certificate is given, so cert-dir is never written; point it inside home
            # anyway so nothing lands in /var/run/kubernetes.
            f"--cert-dir={self.pki_dir}",
            f"--tls-cert-file={c.apiserver.cert}",
            f"--tls-private-key-file={c.apiserver.key}",
            f"--client-ca-file={c.ca.cert}",
            f"--requestheader-client-ca-file={c.front_proxy_ca.cert}",
            f"--requestheader-allowed-names={certs.FRONT_PROXY_CLIENT.user}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={c.front_proxy_client.cert}",
            f"--proxy-client-key-file={c.front_proxy_client.key}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={c.service_account_pub}",
            f"--service-account-signing-key-file={c.service_account_key}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            f"--etcd-servers={self.etcd_endpoint}",
            # No endpoint for the `kubernetes` Service: its only address would be 127.0.0.1, which
            # Endpoints validation rejects, and nothing in this stack reaches the apiserver via it.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            # kubectl kubeloop move switches a PV's node affinity (KEP-5381, alpha in 1.36).
            "--feature-gates=MutablePVNodeAffinity=true",
        ]

    async def _start_apiserver(self) -> float:
        proc = self._new_process("kube-apiserver", self._apiserver_argv())
        await proc.start()
        admin = self.certs.pki.ensure_client(certs.ADMIN)
        ctx = client_ssl_context(self.ca_file, admin.cert, admin.key)
        return await self._healthy(proc, f"{self.server}/readyz", ctx)

    async def _start_kcm(self) -> float:
        c = self.certs
        kubeconfig = c.kubeconfigs[certs.KUBE_CONTROLLER_MANAGER]
        argv = [
            str(self.toolchain.binary("kube-controller-manager")),
            f"--controllers={self.kcm_controllers}",
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            # Each controller acts under its own ServiceAccount, as in a real cluster, so RBAC
            # mistakes show up here the same way.
            "--use-service-account-credentials",
            f"--service-account-private-key-file={c.service_account_key}",
            f"--root-ca-file={c.ca.cert}",
            # Lets the csrsigning controller issue certificates from the stack's CA.
            f"--cluster-signing-cert-file={c.ca.cert}",
            f"--cluster-signing-key-file={c.ca.key}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports.kube_controller_manager}",
            f"--tls-cert-file={c.kube_controller_manager_serving.cert}",
            f"--tls-private-key-file={c.kube_controller_manager_serving.key}",
            "--leader-elect=false",
            "--profiling=false",
        ]
        proc = self._new_process("kube-controller-manager", argv)
        await proc.start()
        url = f"https://127.0.0.1:{self.ports.kube_controller_manager}/healthz"
        return await self._healthy(proc, url, client_ssl_context(self.ca_file))

    async def _start_scheduler(self) -> float:
        c = self.certs
        kubeconfig = c.kubeconfigs[certs.KUBE_SCHEDULER]
        argv = [
            str(self.toolchain.binary("kube-scheduler")),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports.kube_scheduler}",
            f"--tls-cert-file={c.kube_scheduler_serving.cert}",
            f"--tls-private-key-file={c.kube_scheduler_serving.key}",
            "--leader-elect=false",
            "--profiling=false",
        ]
        proc = self._new_process("kube-scheduler", argv)
        await proc.start()
        url = f"https://127.0.0.1:{self.ports.kube_scheduler}/healthz"
        return await self._healthy(proc, url, client_ssl_context(self.ca_file))

    # --- home lock ------------------------------------------------------------------------------

    def _acquire_lock(self) -> None:
        if self._lock_file is not None:
            return
        path = self.home / "stack.lock"
        f = path.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise StackLockedError(
                f"another kubeloop stack (pid {holder}) is running with home {self.home}; stop it first "
                "or set KUBELOOP_HOME (--home) to another directory"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._lock_file = f

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            with contextlib.suppress(OSError):
                self._lock_file.truncate(0)
            self._lock_file.close()  # closing drops the flock
            self._lock_file = None


def running_stack_pid(home: Path, settle: float = 2.0) -> int | None:
    """The pid of the launcher running on `home` (the one holding its stack.lock), None when none
    does. Probing the lock takes it shared for an instant; a launcher that holds it has written its
    pid into it right after taking it, and empties it right before letting it go, so an empty file
    under a held lock is waited out (up to `settle` seconds)."""
    deadline = time.monotonic() + settle
    while True:
        try:
            f = (home / "stack.lock").open()
        except FileNotFoundError:
            return None
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = f.read().strip()
                if text.isdigit():
                    return int(text)
            else:
                return None  # closing the file lets the probe's lock go
        if time.monotonic() > deadline:
            raise StackLockedError(f"{home / 'stack.lock'} is held, but names no process")
        time.sleep(0.05)


def _rotate(log_path: Path) -> None:
    """Keeps the previous run's log beside the new one: a crash is often explained by the run before."""
    if log_path.exists():
        os.replace(log_path, log_path.with_name(f"{log_path.stem}.previous.log"))


def log_unexpected_exit(proc: ManagedProcess, code: int) -> None:
    log.error(
        "COMPONENT DIED; it is not restarted",
        component=proc.name,
        exit_code=code,
        log=str(proc.log_path),
        last_lines=tail(proc.log_path, 10),
    )


__all__ = [
    "KCM_CONTROLLERS",
    "ControlPlane",
    "Ports",
    "StackLockedError",
    "UnhealthyError",
    "default_home",
    "running_stack_pid",
]
