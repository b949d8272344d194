"""kubeloop-snapshot-metadata-setup on a real apiserver, as the sidecar's ServiceAccount (its RBAC in
deploy/rbac/csi-snapshot-metadata.yaml): the certificate it writes is what the SnapshotMetadataService
it makes vouches for; a second run (a new pod) replaces both; without the CRD it says so and exits 0."""

from __future__ import annotations

import asyncio
import base64
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.toolchain import REPO_ROOT
from csi_driver import DRIVER_NAME
from localstack.certs import service_account_identity
from localstack.controlplane import ControlPlane
from localstack.snapshotter import snapshot_metadata_crd
from snapshot_metadata_setup.service import SNAPSHOT_METADATA_SERVICES

from .provisioner_harness import kubectl

pytestmark = pytest.mark.integration
ADDRESS = "kubeloop-snapshot-metadata.kube-system:6443"


async def run_setup(cp: ControlPlane, cert_dir: Path) -> tuple[int, str]:
    kubeconfig = cp.kubeconfig_for(service_account_identity("kubeloop-csi-snapshot-metadata"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "snapshot_metadata_setup.main", f"--kubeconfig={kubeconfig}",
        f"--cert-dir={cert_dir}", f"--address={ADDRESS}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=REPO_ROOT,
    )  # fmt: skip
    out, _ = await proc.communicate()
    return int(proc.returncode or 0), out.decode()


def assert_signed_by(cert_pem: bytes, ca_pem: bytes) -> x509.Certificate:
    cert, ca = x509.load_pem_x509_certificate(cert_pem), x509.load_pem_x509_certificate(ca_pem)
    key = ca.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    assert cert.signature_hash_algorithm is not None
    key.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
    return cert


async def test_setup_points_the_drivers_snapshot_metadata_service_at_the_certificate_it_wrote(
    control_plane: ControlPlane, api: ApiClient, tmp_path: Path
) -> None:
    crd = snapshot_metadata_crd()
    await kubectl(control_plane, "apply", "-f", str(REPO_ROOT / "deploy/rbac/csi-snapshot-metadata.yaml"))
    # Without the CRD: a warning, exit 0, and the certificate all the same (the sidecar starts).
    await kubectl(control_plane, "delete", "--ignore-not-found", "--wait", "-f", str(crd))
    code, out = await run_setup(control_plane, tmp_path / "a")
    assert code == 0, out
    assert "does not serve snapshotmetadataservices.cbt.storage.k8s.io" in out
    assert (tmp_path / "a" / "tls.crt").exists()

    await kubectl(control_plane, "apply", "-f", str(crd))
    await kubectl(control_plane, "wait", "--for=condition=established", "--timeout=60s", "-f", str(crd))
    try:
        code, out = await run_setup(control_plane, tmp_path / "a")
        assert code == 0, out
        assert "SnapshotMetadataService created" in out
        sms = await api.get(SNAPSHOT_METADATA_SERVICES, DRIVER_NAME)
        assert sms["spec"]["address"] == ADDRESS
        assert sms["spec"]["audience"] == "kubeloop-snapshot-metadata"
        ca_pem = base64.b64decode(sms["spec"]["caCert"])
        cert = assert_signed_by((tmp_path / "a" / "tls.crt").read_bytes(), ca_pem)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(names.get_values_for_type(x509.DNSName)) == {
            "kubeloop-snapshot-metadata.kube-system",
            "kubeloop-snapshot-metadata.kube-system.svc",
            "kubeloop-snapshot-metadata.kube-system.svc.cluster.local",
        }
        # The sidecar shares the directory: no CA key there that could sign another server.
        assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["ca.crt", "tls.crt", "tls.key"]

        # A new pod: a new CA and certificate, and the object follows.
        code, out = await run_setup(control_plane, tmp_path / "b")
        assert code == 0, out
        assert "SnapshotMetadataService updated" in out
        again = await api.get(SNAPSHOT_METADATA_SERVICES, DRIVER_NAME)
        new_ca = base64.b64decode(again["spec"]["caCert"])
        assert new_ca != ca_pem
        assert_signed_by((tmp_path / "b" / "tls.crt").read_bytes(), new_ca)

        # Bad input: an address that is no <service>.<namespace>:<port> is refused before anything.
        kubeconfig = control_plane.kubeconfig_for(service_account_identity("kubeloop-csi-snapshot-metadata"))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "snapshot_metadata_setup.main", f"--kubeconfig={kubeconfig}",
            f"--cert-dir={tmp_path / 'c'}", "--address=no-port",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=REPO_ROOT,
        )  # fmt: skip
        bad, _ = await proc.communicate()
        assert proc.returncode == 2 and "is not <service>.<namespace>:<port>" in bad.decode()
        assert not (tmp_path / "c").exists()
    finally:
        try:
            await api.delete(SNAPSHOT_METADATA_SERVICES, DRIVER_NAME)
        except ApiError as e:
            assert e.not_found
