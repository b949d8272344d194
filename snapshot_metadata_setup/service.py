"""The SnapshotMetadataService object (cbt.storage.k8s.io/v1beta1, external-snapshot-metadata's CRD)
and the serving certificate it vouches for.

A backup application finds the sidecar of a snapshot's driver by the cluster-scoped object named
after the driver: `spec.address` to dial, `spec.caCert` to trust, and `spec.audience` to ask a
ServiceAccount token for (the sidecar checks the token with a TokenReview for that audience). The
certificate is made afresh by each controller pod, with a CA of its own, and the object is pointed
at that CA before the sidecar starts: there is no Secret to distribute, rotate or leak, and
`kubectl apply -k deploy/` needs no step before it.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

from controller_runtime.certs import PKI, KeyPair
from controller_runtime.resources import Obj, Resource

SNAPSHOT_METADATA_SERVICES = Resource(
    "cbt.storage.k8s.io", "v1beta1", "snapshotmetadataservices", "SnapshotMetadataService", False
)


@dataclass(frozen=True)
class Endpoint:
    """Where backup applications reach the sidecar: a Service's `<name>.<namespace>` and port."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{text!r} is not <service>.<namespace>:<port>")
        return cls(host, int(port))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def dns_names(self) -> tuple[str, ...]:
        """The names a client may dial the Service by, as the certificate must list them."""
        names = [self.host]
        if self.host.count(".") == 1:  # <service>.<namespace>
            names += [f"{self.host}.svc", f"{self.host}.svc.cluster.local"]
        return tuple(names)


def serving_certificate(directory: Path, endpoint: Endpoint) -> tuple[KeyPair, KeyPair]:
    """(CA, serving pair) in `directory`, made once and reused while valid (a container restart in
    the same pod keeps them, so the object and the sidecar keep agreeing)."""
    pki = PKI(directory, ca_name="kubeloop-snapshot-metadata-ca")
    ca = pki.ensure_ca()
    serving = pki.ensure_serving("tls", endpoint.host, endpoint.dns_names, ())
    return ca, serving


def desired_object(driver: str, endpoint: Endpoint, ca_pem: bytes, audience: str) -> Obj:
    return {
        "apiVersion": SNAPSHOT_METADATA_SERVICES.api_version,
        "kind": SNAPSHOT_METADATA_SERVICES.kind,
        "metadata": {"name": driver, "labels": {"app.kubernetes.io/name": "kubeloop"}},
        "spec": {
            "address": endpoint.address,
            "caCert": base64.b64encode(ca_pem).decode(),
            "audience": audience,
        },
    }
