"""The workloads of kubeloop's kind clusters: a claim and a busybox pod with the claim at /data,
as manifests for `kubectl apply`. Shared by tests/kind, tests/kind_local (tests/kind/workloads.py)
and bench.footprint's `kind` scenario."""

from __future__ import annotations

from . import kind

SLEEP = "sleep 3600"


def claim(
    ns: str, name: str, size: str = "64Mi", storage_class: str = "kubeloop", data_source: str = ""
) -> str:
    """A claim; `data_source`, a flow mapping such as `{kind: PersistentVolumeClaim, name: src}`,
    makes it a restore or a clone."""
    source = f"dataSource: {data_source}" if data_source else ""
    return f"""
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {name}, namespace: {ns}}}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: {storage_class}
  {source}
  resources: {{requests: {{storage: {size}}}}}
"""


def pod(ns: str, name: str, claim_name: str, node: str | None, script: str) -> str:
    """A busybox pod with the claim at /data, on `node` (through the scheduler, by nodeSelector) or,
    with None, wherever the scheduler places it."""
    selector = f"nodeSelector: {{kubernetes.io/hostname: {node}}}" if node else ""
    return f"""
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  {selector}
  terminationGracePeriodSeconds: 1
  containers:
    - name: app
      image: {kind.BUSYBOX_IMAGE}
      command: [sh, -c, "{script}"]
      volumeMounts: [{{name: data, mountPath: /data}}]
  volumes:
    - name: data
      persistentVolumeClaim: {{claimName: {claim_name}}}
"""
