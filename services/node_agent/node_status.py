"""Node status, kubelet's part that keeps the Node object: registers it (labels, the
controller-managed-attach-detach annotation, capacity, addresses, conditions), renews its Lease in
kube-node-lease and re-reports its status now and then."""

from __future__ import annotations

import os

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.clock import SYSTEM_CLOCK, Clock, micro_time, now_rfc3339
from controller_runtime.logs import get_logger
from controller_runtime.resources import LEASES, NODES, Obj
from controller_runtime.volumes import ANN_CONTROLLER_MANAGED, ANN_METRICS_URL

log = get_logger("node-agent")

LEASE_NAMESPACE = "kube-node-lease"


class NodeStatus:
    def __init__(
        self,
        client: ApiClient,
        node_name: str,
        *,
        capacity: tuple[tuple[str, str], ...],
        lease_duration: int,
        heartbeat: float,
        status_report: float,
        clock: Clock = SYSTEM_CLOCK,
        metrics_url: str = "",
    ) -> None:
        self.client = client
        # Where this agent serves kubelet's volume metrics, on its Node for `kubectl kubeloop get
        # volumes` (a real kubelet is reached through the apiserver's node proxy instead).
        self.metrics_url = metrics_url
        self.clock = clock
        self.node_name = node_name
        self.capacity = capacity
        self.lease_duration = lease_duration
        self.heartbeat_period = heartbeat
        self.status_report = status_report

    def _conditions(self) -> list[Obj]:
        now = now_rfc3339()
        conds = [
            ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID"),
            ("Ready", "True", "KubeletReady"),
        ]
        return [
            {"type": t, "status": s, "reason": r, "lastHeartbeatTime": now, "lastTransitionTime": now}
            for t, s, r in conds
        ]

    def _node_status(self) -> Obj:
        capacity = dict(self.capacity)
        return {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": self._conditions(),
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": self.node_name},
            ],
            "nodeInfo": {
                "kubeletVersion": "v0.0.0-kubeloop-node-agent",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "none://0",
                "kernelVersion": os.uname().release,
                "osImage": "kubeloop",
                "kubeProxyVersion": "",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        }

    async def register(self, first_wait: float = 0.1, max_wait: float = 7.0) -> None:
        """Registers the Node, trying until it works as kubelet's registerWithAPIServer does
        (100ms doubling to 7s): at start-up the apiserver may be unreachable, or just restarted
        and still denying what its RBAC cache has not loaded yet."""
        wait = first_wait
        while True:
            try:
                await self._register()
                return
            except (ApiError, OSError) as exc:
                log.warning(
                    "unable to register node with the API server",
                    node=self.node_name,
                    error=str(exc),
                    retry_in=f"{wait:g}s",
                )
            await self.clock.sleep(wait)
            wait = min(max_wait, wait * 2)

    async def _register(self) -> None:
        labels = {
            "kubernetes.io/hostname": self.node_name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
        }
        body = {
            "metadata": {
                "name": self.node_name,
                "labels": labels,
                "annotations": {
                    ANN_CONTROLLER_MANAGED: "true",
                    **({ANN_METRICS_URL: self.metrics_url} if self.metrics_url else {}),
                },
            },
            "status": self._node_status(),
        }
        try:
            await self.client.create(NODES, body)
            log.info("registered node", node=self.node_name)
        except ApiError as exc:
            if not exc.conflict:
                raise
            await self.client.patch(NODES, self.node_name, {"metadata": body["metadata"]})
        await self._report_status()

    async def _report_status(self) -> None:
        status = self._node_status()
        await self.client.patch(NODES, self.node_name, {"status": status}, subresource="status")

    async def _renew_lease(self) -> None:
        spec = {
            "holderIdentity": self.node_name,
            "leaseDurationSeconds": self.lease_duration,
            "renewTime": micro_time(),
        }
        try:
            await self.client.patch(LEASES, self.node_name, {"spec": spec}, namespace=LEASE_NAMESPACE)
        except ApiError as exc:
            if not exc.not_found:
                raise
            node = await self.client.get(NODES, self.node_name)
            owner = {
                "apiVersion": "v1",
                "kind": "Node",
                "name": self.node_name,
                "uid": node["metadata"]["uid"],
            }
            body = {
                "metadata": {
                    "name": self.node_name,
                    "namespace": LEASE_NAMESPACE,
                    "ownerReferences": [owner],
                },
                "spec": spec,
            }
            await self.client.create(LEASES, body)

    async def heartbeat(self) -> None:
        """Renews the Lease every heartbeat period and reports the status every status_report."""
        last_status = self.clock.monotonic()
        while True:
            try:
                await self._renew_lease()
                if self.clock.monotonic() - last_status >= self.status_report:
                    await self._report_status()
                    last_status = self.clock.monotonic()
            except Exception as exc:
                log.warning("node heartbeat failed", error=str(exc))
            await self.clock.sleep(self.heartbeat_period)
