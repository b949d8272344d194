"""`kubeloop-snapshot-metadata-setup`: the init container of the driver's controller pod that gives
the external-snapshot-metadata sidecar its serving certificate and points the driver's
SnapshotMetadataService object at it (snapshot_metadata_setup.service says why it is made here)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from controller_runtime import process
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.driver_names import DRIVER_NAME
from controller_runtime.logs import get_logger, setup_logging

from .service import SNAPSHOT_METADATA_SERVICES, Endpoint, desired_object, serving_certificate

NAME = "kubeloop-snapshot-metadata-setup"
DEFAULT_AUDIENCE = "kubeloop-snapshot-metadata"
log = get_logger("snapshot-metadata-setup")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=NAME,
        description="Writes a TLS serving certificate (tls.crt, tls.key, and the ca.crt that signed it; "
        "the CA's key is not kept) for the external-snapshot-metadata sidecar into --cert-dir, then "
        "creates or updates the cluster-scoped SnapshotMetadataService named after the driver with "
        "the sidecar's address, that CA and the token audience, and exits. Without the "
        "SnapshotMetadataService CRD it says so and exits 0: the driver works without changed "
        "block tracking.",
    )
    parser.add_argument("--cert-dir", type=Path, required=True, help="where the certificate is written")
    parser.add_argument(
        "--address",
        required=True,
        help="the sidecar's Service as backup applications dial it, <service>.<namespace>:<port>",
    )
    parser.add_argument(
        "--audience",
        default=DEFAULT_AUDIENCE,
        help=f"the audience backup applications request their tokens for (default: {DEFAULT_AUDIENCE})",
    )
    parser.add_argument(
        "--driver-name", default=DRIVER_NAME, help=f"the CSI driver's name (default: {DRIVER_NAME})"
    )
    process.add_kube_flags(parser)
    process.add_logging_flags(parser)
    return parser


async def ensure_object(api: ApiClient, wanted: dict[str, object]) -> str:
    """Creates or updates the object; returns what was done ("created", "updated", "unchanged",
    or "no-crd" when the API server does not serve the resource)."""
    name = str(wanted["metadata"]["name"])  # type: ignore[index]
    for _ in range(5):
        try:
            current = await api.get(SNAPSHOT_METADATA_SERVICES, name)
        except ApiError as e:
            if not e.not_found:
                raise
            try:
                await api.create(SNAPSHOT_METADATA_SERVICES, wanted)
                return "created"
            except ApiError as c:
                if c.not_found:  # the resource itself: no CRD
                    return "no-crd"
                if not c.already_exists:
                    raise
                continue
        if current.get("spec") == wanted["spec"]:
            return "unchanged"
        current["spec"] = wanted["spec"]
        try:
            await api.update(SNAPSHOT_METADATA_SERVICES, current)
            return "updated"
        except ApiError as e:
            if not e.conflict:
                raise
    raise RuntimeError(f"SnapshotMetadataService {name} kept changing under 5 updates")


async def run(args: argparse.Namespace) -> int:
    try:
        endpoint = Endpoint.parse(args.address)
    except ValueError as e:
        print(f"{NAME}: --address: {e}", file=sys.stderr)
        return 2
    ca, _ = serving_certificate(args.cert_dir, endpoint)
    # The sidecar shares the directory: it gets the CA's certificate, never the key that could
    # sign another serving certificate clients would trust.
    ca_pem = ca.cert.read_bytes()
    ca.key.unlink(missing_ok=True)
    log.info("serving certificate written", dir=str(args.cert_dir), names=",".join(endpoint.dns_names))
    api = await ApiClient.from_kubeconfig(args.kubeconfig, args.kube_api_qps, args.kube_api_burst, NAME)
    try:
        done = await ensure_object(api, desired_object(args.driver_name, endpoint, ca_pem, args.audience))
    finally:
        await api.close()
    if done == "no-crd":
        log.warning(
            "the API server does not serve snapshotmetadataservices.cbt.storage.k8s.io; backup "
            "applications cannot discover the sidecar until external-snapshot-metadata's CRD is applied",
            driver=args.driver_name,
        )
    else:
        log.info(f"SnapshotMetadataService {done}", name=args.driver_name, address=endpoint.address)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    args = process.parse_args(build_parser(), argv)
    setup_logging(args.log_format, args.verbosity)
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
