"""The local stack's PKI: one CA, serving certificates, the service-account signing key pair, a
client certificate per identity and a kubeconfig with embedded data for each.

Everything lives in one directory (mode 0700, files 0600). Generation is idempotent: a file that
exists, parses, is signed by the CA, matches its key and its expected subject/SANs and is not close
to expiry is reused, so restarting `make up` keeps the tokens and kubeconfigs users already hold.
ECDSA P-256 keeps generation in the milliseconds; every Kubernetes component accepts it.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from controller_runtime.files import write_atomic

CA_VALIDITY = dt.timedelta(days=3650)
LEAF_VALIDITY = dt.timedelta(days=365)
# A certificate closer than this to its end is replaced rather than reused, so a long-running stack
# started from a reused certificate does not hit expiry mid-session.
RENEW_BEFORE = dt.timedelta(days=7)

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


@dataclass(frozen=True)
class Identity:
    """A user the API server authenticates from a client certificate (CN = user, O = groups)."""

    user: str
    groups: tuple[str, ...] = ()

    @property
    def file_stem(self) -> str:
        # `system:serviceaccount:kube-system:x` -> `system-serviceaccount-kube-system-x`
        return re.sub(r"[^A-Za-z0-9._-]+", "-", self.user).strip("-") or "user"


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


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey | None:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return None
    return key if isinstance(key, ec.EllipticCurvePrivateKey) else None


def _load_cert(path: Path) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None


def _name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _subject_of(cert: x509.Certificate) -> tuple[str, tuple[str, ...]]:
    cn = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    orgs = tuple(str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME))
    return (cn[0] if cn else "", orgs)


def _sans_of(cert: x509.Certificate) -> tuple[set[str], set[str]]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set(), set()
    dns = set(ext.get_values_for_type(x509.DNSName))
    ips = {str(ip) for ip in ext.get_values_for_type(x509.IPAddress)}
    return dns, ips


@dataclass(frozen=True)
class _LeafSpec:
    common_name: str
    organizations: tuple[str, ...] = ()
    dns_names: tuple[str, ...] = ()
    ips: tuple[str, ...] = ()
    server: bool = False
    client: bool = False


@dataclass
class PKI:
    """The certificate directory of one stack. Each `ensure_*` reuses valid files or (re)creates them."""

    directory: Path
    ca_name: str = "kubeloop-ca"
    _ca_key: ec.EllipticCurvePrivateKey | None = field(default=None, repr=False)
    _ca_cert: x509.Certificate | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)

    @property
    def ca(self) -> KeyPair:
        return KeyPair(self.directory / "ca.crt", self.directory / "ca.key")

    @property
    def service_account_key(self) -> Path:
        return self.directory / "sa.key"

    @property
    def service_account_pub(self) -> Path:
        return self.directory / "sa.pub"

    # --- CA -------------------------------------------------------------------------------------

    def ensure_ca(self) -> KeyPair:
        if self._ca_cert is not None:
            return self.ca
        key, cert = _load_key(self.ca.key), _load_cert(self.ca.cert)
        if key is None or cert is None or not self._ca_usable(key, cert):
            key = _new_key()
            name = _name(self.ca_name, ("kubeloop",))
            now = _now()
            cert = (
                x509.CertificateBuilder()
                .subject_name(name)
                .issuer_name(name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + CA_VALIDITY)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(
                    x509.KeyUsage(
                        digital_signature=True,
                        content_commitment=False,
                        key_encipherment=False,
                        data_encipherment=False,
                        key_agreement=False,
                        key_cert_sign=True,
                        crl_sign=True,
                        encipher_only=False,
                        decipher_only=False,
                    ),
                    critical=True,
                )
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256())
            )
            write_atomic(self.ca.key, _key_pem(key))
            write_atomic(self.ca.cert, cert.public_bytes(serialization.Encoding.PEM))
        self._ca_key, self._ca_cert = key, cert
        return self.ca

    def _ca_usable(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> bool:
        if cert.public_key() != key.public_key() or _subject_of(cert)[0] != self.ca_name:
            return False
        if cert.not_valid_after_utc - _now() < RENEW_BEFORE:
            return False
        try:
            return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
        except x509.ExtensionNotFound:
            return False

    # --- leaves ---------------------------------------------------------------------------------

    def _leaf_usable(self, spec: _LeafSpec, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> bool:
        assert self._ca_cert is not None
        ca_pub = self._ca_cert.public_key()
        assert isinstance(ca_pub, ec.EllipticCurvePublicKey)
        try:
            ca_pub.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, ValueError):
            return False
        if cert.issuer != self._ca_cert.subject or cert.public_key() != key.public_key():
            return False
        if cert.not_valid_after_utc - _now() < RENEW_BEFORE:
            return False
        if _subject_of(cert) != (spec.common_name, spec.organizations):
            return False
        return _sans_of(cert) == (set(spec.dns_names), set(spec.ips))

    def _ensure_leaf(self, stem: str, spec: _LeafSpec) -> KeyPair:
        self.ensure_ca()
        assert self._ca_key is not None and self._ca_cert is not None
        pair = KeyPair(self.directory / f"{stem}.crt", self.directory / f"{stem}.key")
        key, cert = _load_key(pair.key), _load_cert(pair.cert)
        if key is not None and cert is not None and self._leaf_usable(spec, key, cert):
            return pair
        key = _new_key()
        now = _now()
        usages = []
        if spec.server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if spec.client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(spec.common_name, spec.organizations))
            .issuer_name(self._ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + LEAF_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._ca_key.public_key()), critical=False
            )
        )
        if spec.dns_names or spec.ips:
            names: list[x509.GeneralName] = [x509.DNSName(d) for d in spec.dns_names]
            names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in spec.ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        write_atomic(pair.key, _key_pem(key))
        write_atomic(pair.cert, cert.public_bytes(serialization.Encoding.PEM))
        return pair

    def ensure_serving(
        self, stem: str, common_name: str, dns_names: Sequence[str], ips: Sequence[str]
    ) -> KeyPair:
        return self._ensure_leaf(
            stem, _LeafSpec(common_name, dns_names=tuple(dns_names), ips=tuple(ips), server=True)
        )

    def ensure_apiserver(self) -> KeyPair:
        return self.ensure_serving("apiserver", "kube-apiserver", APISERVER_DNS_NAMES, APISERVER_IPS)

    def ensure_client(self, identity: Identity) -> KeyPair:
        return self._ensure_leaf(
            f"client-{identity.file_stem}",
            _LeafSpec(identity.user, tuple(identity.groups), client=True),
        )

    def ensure_service_account_keys(self) -> tuple[Path, Path]:
        """The key pair the apiserver signs ServiceAccount tokens with (and kcm's token controller)."""
        key = _load_key(self.service_account_key)
        if key is None:
            key = _new_key()
            write_atomic(self.service_account_key, _key_pem(key))
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
