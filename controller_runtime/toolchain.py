"""Where the pinned Go binaries live (see tools/versions.env and tools/build-binaries.sh)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
VERSIONS_FILE = REPO_ROOT / "tools" / "versions.env"
BUILD_SCRIPT = REPO_ROOT / "tools" / "build-binaries.sh"


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    versions: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip()
    return versions


class MissingBinaryError(RuntimeError):
    pass


class MissingModuleError(RuntimeError):
    pass


def go_module_dir(module: str, version: str) -> Path:
    """A Go module's source in the module cache, fetched through the Go module proxy when it is not
    there yet (`go mod download`): where upstream's manifests and sources are read from."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    proc = subprocess.run(
        [go, "mod", "download", "-json", f"{module}@{version}"], capture_output=True, text=True, cwd="/"
    )
    info = json.loads(proc.stdout or "{}")
    if "Dir" not in info:
        raise MissingModuleError(
            f"{module}@{version} is not in the Go module cache: {info.get('Error') or proc.stderr}"
        )
    return Path(info["Dir"])


@dataclass(frozen=True)
class Toolchain:
    """Paths of the cached Go binaries at the pinned versions."""

    cache: Path
    versions: dict[str, str]

    @classmethod
    def default(cls) -> Toolchain:
        cache = Path(os.environ.get("KUBELOOP_CACHE", Path.home() / ".cache" / "kubeloop"))
        return cls(cache=cache, versions=read_versions())

    def _dir(self, group: str) -> Path:
        dirs = {
            "kubernetes": f"kubernetes-{self.versions['KUBERNETES_VERSION']}",
            "etcd": f"etcd-{self.versions['ETCD_VERSION']}",
            "csi-sanity": f"csi-test-{self.versions['CSI_TEST_VERSION']}",
            "kind": f"kind-{self.versions['KIND_VERSION']}",
            "e2e": f"kubernetes-e2e-{self.versions['KUBERNETES_VERSION']}",
            "helm": f"helm-{self.versions['HELM_VERSION']}",
            "prometheus": f"prometheus-{self.versions['PROMETHEUS_VERSION']}",
        }
        return self.cache / "bin" / dirs[group]

    def binary(self, name: str) -> Path:
        group = {
            "kube-apiserver": "kubernetes",
            "kube-controller-manager": "kubernetes",
            "kube-scheduler": "kubernetes",
            "kubectl": "kubernetes",
            "etcd": "etcd",
            "etcdctl": "etcd",
            "csi-sanity": "csi-sanity",
            "kind": "kind",
            "e2e.test": "e2e",
            "agnhost": "e2e",
            "helm": "helm",
            "prometheus": "prometheus",
            "promtool": "prometheus",
        }[name]
        path = self._dir(group) / name
        if not os.access(path, os.X_OK):
            raise MissingBinaryError(
                f"{name} is not built at {path}; run `bash {BUILD_SCRIPT.relative_to(REPO_ROOT)} {group}` "
                "(or `make binaries`), which builds it through the Go module proxy"
            )
        return path

    @property
    def kubernetes_version(self) -> str:
        return self.versions["KUBERNETES_VERSION"]
