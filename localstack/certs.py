"""The local stack's PKI: one CA, serving certificates, the service-account signing key pair, a
client certificate per identity and a kubeconfig with embedded data for each.

Everything lives in one directory (mode 0700, files 0600). Generation is idempotent (the shared
layer's controller_runtime.certs does the CA and the leaves): restarting `make up` keeps the tokens
and kubeconfigs users already hold.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography.hazmat.primitives import serialization

from controller_runtime import certs
from controller_runtime.certs import Identity, KeyPair
from controller_runtime.files import write_atomic

# The apiserver's names as seen from the host and from (future) in-cluster clients. 10.0.0.1 is the
# first address of --service-cluster-ip-range: present as a SAN only, nothing ever dials it.
APISERVER_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
APISERVER_IPS = ("127.0.0.1", "10.0.0.1")
LOOPBACK_DNS_NAMES = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1",)


ADMIN = Identity("kubeloop-admin", ("system:masters",))
KUBE_CONTROLLER_MANAGER = Identity("system:kube-controller-manager")
KUBE_SCHEDULER = Identity("system:kube-scheduler")
FRONT_PROXY_CLIENT = Identity("front-proxy-client")


def service_account_identity(name: str, namespace: str = "kube-system") -> Identity:
    """The identity a ServiceAccount's token would carry, so RBAC bound to the ServiceAccount
    applies to a process that authenticates with this client certificate instead of a token."""
    return Identity(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}"),
    )


class PKI(certs.PKI):
    """The certificate directory of one stack: the shared PKI with the API server's serving
    certificate, the service-account signing keys and a kubeconfig per identity."""

    @property
    def service_account_key(self) -> Path:
        return self.directory / "sa.key"

    @property
    def service_account_pub(self) -> Path:
        return self.directory / "sa.pub"

    def ensure_apiserver(self) -> KeyPair:
        return self.ensure_serving("apiserver", "kube-apiserver", APISERVER_DNS_NAMES, APISERVER_IPS)

    def ensure_service_account_keys(self) -> tuple[Path, Path]:
        """The key pair the apiserver signs ServiceAccount tokens with (and kcm's token controller)."""
        key = certs.load_key(self.service_account_key)
        if key is None:
            key = certs.new_key()
            write_atomic(self.service_account_key, certs.key_pem(key))
        pub = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        try:
            current = self.service_account_pub.read_bytes()
        except OSError:
            current = b""
        if current != pub:
            write_atomic(self.service_account_pub, pub)
        return self.service_account_key, self.service_account_pub

    # --- kubeconfigs ----------------------------------------------------------------------------

    def write_kubeconfig(self, identity: Identity, server: str, path: Path) -> Path:
        """A self-contained kubeconfig (embedded CA, cert and key) for `identity` against `server`.
        Rewritten only when its content changes, so an open editor or a watcher is not disturbed."""
        pair = self.ensure_client(identity)

        def b64(p: Path) -> str:
            return base64.b64encode(p.read_bytes()).decode()

        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "kubeloop",
                    "cluster": {"server": server, "certificate-authority-data": b64(self.ca.cert)},
                }
            ],
            "users": [
                {
                    "name": identity.user,
                    "user": {"client-certificate-data": b64(pair.cert), "client-key-data": b64(pair.key)},
                }
            ],
            "contexts": [{"name": "kubeloop", "context": {"cluster": "kubeloop", "user": identity.user}}],
            "current-context": "kubeloop",
            "preferences": {},
        }
        data = yaml.safe_dump(doc, sort_keys=False).encode()
        if not path.parent.exists():
            path.parent.mkdir(parents=True)
            os.chmod(path.parent, 0o700)
        try:
            unchanged = path.read_bytes() == data and (path.stat().st_mode & 0o777) == 0o600
        except OSError:
            unchanged = False
        if not unchanged:
            write_atomic(path, data)
        return path


@dataclass(frozen=True)
class StackCerts:
    """Paths of everything `ensure_stack_certs` produced."""

    pki: PKI
    ca: KeyPair
    apiserver: KeyPair
    kube_controller_manager_serving: KeyPair
    kube_scheduler_serving: KeyPair
    front_proxy_ca: KeyPair
    front_proxy_client: KeyPair
    service_account_key: Path
    service_account_pub: Path
    kubeconfigs: dict[Identity, Path]


def ensure_stack_certs(
    directory: Path,
    server: str,
    kubeconfig_dir: Path,
    admin_kubeconfig: Path | None = None,
    extra_identities: Sequence[Identity] = (),
) -> StackCerts:
    """Creates (or reuses) every certificate the stack needs plus a kubeconfig per identity in
    `kubeconfig_dir/<identity>.kubeconfig` (the admin's at `admin_kubeconfig` when given)."""
    pki = PKI(directory)
    ca = pki.ensure_ca()
    apiserver = pki.ensure_apiserver()
    # kcm and the scheduler serve /healthz over TLS; certificates from our CA (instead of their own
    # self-signed ones) let the launcher verify what it talks to.
    kcm_serving = pki.ensure_serving(
        "kube-controller-manager-serving", "kube-controller-manager", LOOPBACK_DNS_NAMES, LOOPBACK_IPS
    )
    sched_serving = pki.ensure_serving(
        "kube-scheduler-serving", "kube-scheduler", LOOPBACK_DNS_NAMES, LOOPBACK_IPS
    )
    # The aggregation-layer (front proxy) chain has its own CA, as in kubeadm: a certificate from the
    # main CA must never be able to assert X-Remote-User headers. kcm and the scheduler read this CA
    # from kube-system/extension-apiserver-authentication and log errors every few seconds without it.
    front_proxy = PKI(directory / "front-proxy", ca_name="kubeloop-front-proxy-ca")
    front_proxy_ca = front_proxy.ensure_ca()
    front_proxy_client = front_proxy.ensure_client(FRONT_PROXY_CLIENT)
    sa_key, sa_pub = pki.ensure_service_account_keys()
    kubeconfigs: dict[Identity, Path] = {}
    for identity in (ADMIN, KUBE_CONTROLLER_MANAGER, KUBE_SCHEDULER, *extra_identities):
        path = kubeconfig_dir / f"{identity.file_stem}.kubeconfig"
        if identity == ADMIN and admin_kubeconfig is not None:
            path = admin_kubeconfig
        kubeconfigs[identity] = pki.write_kubeconfig(identity, server, path)
    return StackCerts(
        pki=pki,
        ca=ca,
        apiserver=apiserver,
        kube_controller_manager_serving=kcm_serving,
        kube_scheduler_serving=sched_serving,
        front_proxy_ca=front_proxy_ca,
        front_proxy_client=front_proxy_client,
        service_account_key=sa_key,
        service_account_pub=sa_pub,
        kubeconfigs=kubeconfigs,
    )
