"""Certificates from a CA of one's own: a CA, serving certificates and client certificates in one
directory (mode 0700, files 0600).

Generation is idempotent: a file that exists, parses, is signed by the CA, matches its key and its
expected subject/SANs and is not close to expiry is reused, so a restart keeps what clients already
trust. ECDSA P-256 keeps generation in the milliseconds; every Kubernetes component accepts it.
Production code (snapshot_metadata_setup's serving certificate) and the local stack's PKI
(localstack.certs, which adds the API server's, the service-account keys and kubeconfigs) use it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .files import write_atomic

CA_VALIDITY = dt.timedelta(days=3650)
LEAF_VALIDITY = dt.timedelta(days=365)
# A certificate closer than this to its end is replaced rather than reused, so a long-running stack
# started from a reused certificate does not hit expiry mid-session.
RENEW_BEFORE = dt.timedelta(days=7)


@dataclass(frozen=True)
class Identity:
    """A user the API server authenticates from a client certificate (CN = user, O = groups)."""

    user: str
    groups: tuple[str, ...] = ()

    @property
    def file_stem(self) -> str:
        # `system:serviceaccount:kube-system:x` -> `system-serviceaccount-kube-system-x`
        return re.sub(r"[^A-Za-z0-9._-]+", "-", self.user).strip("-") or "user"


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_key(path: Path) -> ec.EllipticCurvePrivateKey | None:
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


def _key_usage(signs_certificates: bool) -> x509.KeyUsage:
    """Digital signatures always; certificate and CRL signing for a CA only."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs_certificates,
        crl_sign=signs_certificates,
        encipher_only=False,
        decipher_only=False,
    )


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
    """A certificate directory with its CA. Each `ensure_*` reuses valid files or (re)creates them."""

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

    # --- CA -------------------------------------------------------------------------------------

    def ensure_ca(self) -> KeyPair:
        if self._ca_cert is not None:
            return self.ca
        key, cert = load_key(self.ca.key), _load_cert(self.ca.cert)
        if key is None or cert is None or not self._ca_usable(key, cert):
            key = new_key()
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
                .add_extension(_key_usage(signs_certificates=True), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256())
            )
            write_atomic(self.ca.key, key_pem(key))
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
        key, cert = load_key(pair.key), _load_cert(pair.cert)
        if key is not None and cert is not None and self._leaf_usable(spec, key, cert):
            return pair
        key = new_key()
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
            .add_extension(_key_usage(signs_certificates=False), critical=True)
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
        write_atomic(pair.key, key_pem(key))
        write_atomic(pair.cert, cert.public_bytes(serialization.Encoding.PEM))
        return pair

    def ensure_serving(
        self, stem: str, common_name: str, dns_names: Sequence[str], ips: Sequence[str]
    ) -> KeyPair:
        return self._ensure_leaf(
            stem, _LeafSpec(common_name, dns_names=tuple(dns_names), ips=tuple(ips), server=True)
        )

    def ensure_client(self, identity: Identity) -> KeyPair:
        return self._ensure_leaf(
            f"client-{identity.file_stem}",
            _LeafSpec(identity.user, tuple(identity.groups), client=True),
        )
