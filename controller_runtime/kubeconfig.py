"""Where the API is and how to authenticate: a kubeconfig's current context, or the in-cluster
service account.

The common cases (client certificate, bearer token or token file, CA, insecure-skip-tls-verify)
are read here directly. kubernetes_asyncio's loader is only imported for what it alone handles
(exec credential plugins, auth providers, basic auth): importing it loads every generated API
model, about 1 s of CPU and 40 MiB of memory in each component's start-up.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# client-go re-reads a projected service-account token at most this often.
TOKEN_REFRESH_SECONDS = 60.0


class ClientConfig(Protocol):
    """What ApiClient reads from a configuration: the attributes of kubernetes_asyncio's
    Configuration, so either may be passed."""

    host: str
    ssl_ca_cert: str | None
    verify_ssl: bool
    cert_file: str | None
    key_file: str | None
    api_key: dict[str, str]
    refresh_api_key_hook: Any


@dataclass
class Config:
    host: str = "http://localhost"
    ssl_ca_cert: str | None = None
    verify_ssl: bool = True
    cert_file: str | None = None
    key_file: str | None = None
    api_key: dict[str, str] = field(default_factory=dict)
    # Called before each request with the config, to renew api_key (a rotated token file).
    refresh_api_key_hook: Any = None


class NeedsFullLoaderError(Exception):
    """The kubeconfig uses a credential source only kubernetes_asyncio implements."""


# Auth settings of a kubeconfig user that only the full loader implements.
_FULL_LOADER_AUTH = ("exec", "auth-provider", "username", "password")


def _named(items: list[dict[str, Any]] | None, name: str, kind: str, path: str) -> dict[str, Any]:
    for item in items or []:
        if item.get("name") == name:
            return dict(item.get(kind) or {})
    raise ValueError(f"kubeconfig {path}: no {kind} named {name!r}")


def _data_file(data: str, suffix: str) -> str:
    """A private file holding base64 `data` (ssl loads certificates and keys from files only),
    removed at exit."""
    fd, name = tempfile.mkstemp(prefix="kubeloop-", suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        f.write(base64.b64decode(data))
    atexit.register(lambda: Path(name).unlink(missing_ok=True))
    return name


def _file_or_data(section: dict[str, Any], key: str, base: Path, suffix: str) -> str | None:
    """`key`-data (inline, base64) wins over `key` (a path, relative to the kubeconfig's
    directory), as in client-go."""
    data = section.get(f"{key}-data")
    if data:
        return _data_file(str(data), suffix)
    path = section.get(key)
    if path:
        return str(base / str(path))
    return None


def _token_hook(path: Path) -> Any:
    """A refresh hook that re-reads a token file once TOKEN_REFRESH_SECONDS have passed."""
    read_at = time.monotonic()

    def refresh(cfg: ClientConfig) -> None:
        nonlocal read_at
        now = time.monotonic()
        if now - read_at >= TOKEN_REFRESH_SECONDS:
            read_at = now
            with contextlib.suppress(OSError):
                cfg.api_key["BearerToken"] = path.read_text().strip()

    return refresh


def parse_kubeconfig(path: str, context: str | None = None) -> Config:
    """The configuration of `context` (default: the current context) of the kubeconfig at
    `path`; NeedsFullLoaderError for credential plugins and other auth this module does not do."""
    import yaml  # here: a pod's in-cluster configuration needs no YAML parser (issue 49)

    base = Path(path).resolve().parent
    doc = yaml.safe_load(Path(path).read_text()) or {}
    name = context or doc.get("current-context")
    if not name:
        raise ValueError(f"kubeconfig {path}: no current-context")
    ctx = _named(doc.get("contexts"), name, "context", path)
    cluster = _named(doc.get("clusters"), ctx.get("cluster", ""), "cluster", path)
    user = _named(doc.get("users"), ctx["user"], "user", path) if ctx.get("user") else {}
    if any(user.get(k) for k in _FULL_LOADER_AUTH):
        raise NeedsFullLoaderError(path)
    cfg = Config(
        host=str(cluster.get("server") or "http://localhost"),
        ssl_ca_cert=_file_or_data(cluster, "certificate-authority", base, ".crt"),
        verify_ssl=not cluster.get("insecure-skip-tls-verify", False),
        cert_file=_file_or_data(user, "client-certificate", base, ".crt"),
        key_file=_file_or_data(user, "client-key", base, ".key"),
    )
    if user.get("token"):
        cfg.api_key["BearerToken"] = str(user["token"])
    elif user.get("tokenFile"):
        token_file = base / str(user["tokenFile"])
        cfg.api_key["BearerToken"] = token_file.read_text().strip()
        cfg.refresh_api_key_hook = _token_hook(token_file)
    return cfg


async def load(path: str | None) -> ClientConfig:
    """The configuration of the kubeconfig at `path`, or of the in-cluster service account when
    `path` is empty. A directory at `path` is a service account's (its `token` and `ca.crt`, as a
    token Secret mounts them), used in-cluster: how the components kubeloop-node-plugin runs in
    one process each keep their own identity."""
    if not path:
        return in_cluster()
    if Path(path).is_dir():  # noqa: ASYNC240 (a stat of a local file, at start-up)
        return in_cluster(Path(path))
    try:
        return parse_kubeconfig(path)
    except NeedsFullLoaderError:
        pass
    from kubernetes_asyncio import config as kube_config
    from kubernetes_asyncio.client import Configuration

    full = Configuration()
    await kube_config.load_kube_config(config_file=path, client_configuration=full, persist_config=False)
    return full  # type: ignore[no-any-return]


def in_cluster(directory: Path = SERVICE_ACCOUNT_DIR) -> Config:
    """The pod's service account: the apiserver from the environment, the projected token (which
    the kubelet rotates, so it is re-read) and the cluster's CA."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise RuntimeError("not in a cluster: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are unset")
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    token = directory / "token"
    cfg = Config(
        host=f"https://{host}:{port}",
        ssl_ca_cert=str(directory / "ca.crt"),
        refresh_api_key_hook=_token_hook(token),
    )
    cfg.api_key["BearerToken"] = token.read_text().strip()
    return cfg
