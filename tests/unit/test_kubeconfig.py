"""controller_runtime.kubeconfig: the kubeconfig and in-cluster settings ApiClient is built from,
read without kubernetes_asyncio for the common cases."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller_runtime import kubeconfig
from controller_runtime.kubeconfig import NeedsFullLoaderError, in_cluster, load, parse_kubeconfig


def _write(path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "main",
        "contexts": [
            {"name": "other", "context": {"cluster": "nowhere", "user": "nobody"}},
            {"name": "main", "context": {"cluster": "c", "user": "u"}},
        ],
        "clusters": [{"name": "c", "cluster": cluster or {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "u", "user": user}],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def test_embedded_certificates_become_private_files(tmp_path: Path) -> None:
    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    path = _write(
        tmp_path / "kc",
        {"client-certificate-data": b64("CERT"), "client-key-data": b64("KEY")},
        {"server": "https://127.0.0.1:6443", "certificate-authority-data": b64("CA")},
    )
    cfg = parse_kubeconfig(str(path))
    assert cfg.host == "https://127.0.0.1:6443"
    assert cfg.verify_ssl
    assert cfg.ssl_ca_cert and cfg.cert_file and cfg.key_file
    assert Path(cfg.ssl_ca_cert).read_text() == "CA"
    assert Path(cfg.cert_file).read_text() == "CERT"
    assert Path(cfg.key_file).read_text() == "KEY"
    assert Path(cfg.key_file).stat().st_mode & 0o077 == 0
    assert cfg.api_key == {}
    assert cfg.refresh_api_key_hook is None


def test_file_paths_are_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    path = _write(
        tmp_path / "sub" / "kc",
        {"client-certificate": "u.crt", "client-key": "/abs/u.key"},
        {"server": "https://h:1", "certificate-authority": "ca.crt", "insecure-skip-tls-verify": True},
    )
    cfg = parse_kubeconfig(str(path))
    assert cfg.ssl_ca_cert == str(tmp_path / "sub" / "ca.crt")
    assert cfg.cert_file == str(tmp_path / "sub" / "u.crt")
    assert cfg.key_file == "/abs/u.key"
    assert not cfg.verify_ssl


def test_token_and_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_kubeconfig(str(_write(tmp_path / "a", {"token": "t1"}))).api_key == {"BearerToken": "t1"}
    (tmp_path / "tok").write_text("t2\n")
    cfg = parse_kubeconfig(str(_write(tmp_path / "b", {"tokenFile": "tok"})))
    assert cfg.api_key == {"BearerToken": "t2"}
    (tmp_path / "tok").write_text("t3\n")
    cfg.refresh_api_key_hook(cfg)
    assert cfg.api_key == {"BearerToken": "t2"}, "re-read only once the refresh period passed"
    monkeypatch.setattr(kubeconfig, "TOKEN_REFRESH_SECONDS", 0.0)
    cfg.refresh_api_key_hook(cfg)
    assert cfg.api_key == {"BearerToken": "t3"}


def test_a_named_context_and_a_missing_one(tmp_path: Path) -> None:
    path = _write(tmp_path / "kc", {"token": "t"})
    with pytest.raises(ValueError, match="no cluster named 'nowhere'"):
        parse_kubeconfig(str(path), context="other")
    with pytest.raises(ValueError, match="no context named 'gone'"):
        parse_kubeconfig(str(path), context="gone")


@pytest.mark.parametrize(
    "user",
    [
        {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "x"}},
        {"auth-provider": {"name": "oidc"}},
        {"username": "a", "password": "b"},
    ],
)
def test_credential_plugins_are_left_to_kubernetes_asyncio(tmp_path: Path, user: dict[str, Any]) -> None:
    with pytest.raises(NeedsFullLoaderError):
        parse_kubeconfig(str(_write(tmp_path / "kc", user)))


async def test_load_falls_back_to_the_full_loader(tmp_path: Path) -> None:
    path = _write(tmp_path / "kc", {"username": "a", "password": "b"})
    cfg = await kubeconfig.load(str(path))
    assert cfg.host == "https://127.0.0.1:6443"
    assert "kubernetes_asyncio" in sys.modules


def test_load_does_not_import_kubernetes_asyncio_for_certificates(tmp_path: Path) -> None:
    """Start-up cost: the common path must stay free of the generated API models."""
    path = _write(tmp_path / "kc", {"token": "t"})
    code = (
        "import asyncio, sys; from controller_runtime.client import ApiClient; "
        f"asyncio.run(ApiClient.from_kubeconfig({str(path)!r})); "
        "assert 'kubernetes_asyncio' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_in_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_text("sa-token\n")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    cfg = in_cluster(tmp_path)
    assert cfg.host == "https://[fd00::1]:443"
    assert cfg.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert cfg.api_key == {"BearerToken": "sa-token"}
    assert cfg.refresh_api_key_hook is not None
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(RuntimeError, match="not in a cluster"):
        in_cluster(tmp_path)


async def test_a_kubeconfig_that_is_a_directory_is_a_service_accounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kubeloop-node-plugin gives each component its own token Secret's directory as --kubeconfig."""
    (tmp_path / "token").write_text("resizer-token\n")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    cfg = await load(str(tmp_path))
    assert cfg.host == "https://10.96.0.1:443" and cfg.api_key == {"BearerToken": "resizer-token"}
