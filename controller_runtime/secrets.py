"""A Secret's data as the CSI sidecars hand it to a driver: the `map<string, string>` of a request's
`secrets` field, which proto3 requires to be UTF-8. The Go sidecars copy the bytes into Go strings
and the request fails to marshal in the client, so the driver is never called; the text of that
failure is what the Go sidecar's event or status carries, and so what kubeloop's says."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

from .resources import SECRETS, Obj

if TYPE_CHECKING:  # the client is imported where a Secret is read: csi_errors, which imports this
    # module, is imported by processes that talk to no apiserver (node-driver-registrar)
    from .client import ApiClient

# grpc-go's error for a request that proto.Marshal refuses, as a Go client prints it.
NOT_UTF8 = (
    "rpc error: code = Internal desc = grpc: error while marshaling: string field contains invalid UTF-8"
)


class SecretNotSendable(Exception):
    """The Secret's data cannot travel in a CSI request."""


class SecretUnavailable(Exception):
    """The Secret a CSI request names cannot be read (missing, or not ours to read): the request
    is not sent, and a later attempt may find it."""


def csi_secrets(secret: Obj) -> dict[str, str]:
    """The Secret's data, decoded. Raises SecretNotSendable (NOT_UTF8) for a value that is not
    UTF-8 (binary keys, certificates in DER): a Python decode error would reach only the log."""
    out: dict[str, str] = {}
    for key, value in (secret.get("data") or {}).items():
        try:
            out[key] = base64.b64decode(value).decode()
        except UnicodeDecodeError as exc:
            raise SecretNotSendable(NOT_UTF8) from exc
    return out


async def read_csi_secrets(client: ApiClient, name: str, namespace: str) -> dict[str, str]:
    """The named Secret's data for a CSI request, as external-provisioner and external-resizer read
    it: SecretUnavailable, in their words, when it cannot be read; SecretNotSendable when it can
    but cannot be sent."""
    from .client import ApiError

    try:
        secret = await client.get(SECRETS, name, namespace)
    except ApiError as exc:
        raise SecretUnavailable(
            f"error getting secret {name} in namespace {namespace}: {exc.message}"
        ) from exc
    return csi_secrets(secret)
