"""Pods in the integration tests, which no kubelet runs: one that uses a claim (`pod`), created once
its namespace may hold pods (`create_pod`), and all of a namespace's deleted at once
(`force_delete_pods`)."""

from __future__ import annotations

import contextlib

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.resources import PODS, Obj
from tests.support.namespaces import default_service_account


def pod(name: str, claim: str) -> Obj:
    """A pod of the claim. It tolerates the taints of a node without a kubelet: admission makes a
    new Node not-ready and kcm's node lifecycle controller lifts that once it reads the Ready
    status, but calls it unreachable when no heartbeat (Lease) follows within its grace period. On
    a busy machine the scheduler could meet either taint and leave the pod, and its claim, waiting."""
    return {
        "metadata": {"name": name},
        "spec": {
            "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}],
            "terminationGracePeriodSeconds": 0,
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists"},
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists"},
            ],
        },
    }


async def create_pod(api: ApiClient, namespace: str, name: str, claim: str, scheduler: str = "") -> Obj:
    """Creates the pod once the namespace's default ServiceAccount exists (kcm makes it shortly
    after the namespace; admission refuses pods before that)."""
    await default_service_account(api, namespace, timeout=30)
    body = pod(name, claim)
    if scheduler:
        body["spec"]["schedulerName"] = scheduler
    return await api.create(PODS, body, namespace)


async def force_delete_pods(api: ApiClient, namespace: str) -> None:
    for p in (await api.list_page(PODS, namespace))["items"]:
        with contextlib.suppress(ApiError):
            await api.request(
                "DELETE",
                PODS.path(namespace, p["metadata"]["name"]),
                body={"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0},
            )
