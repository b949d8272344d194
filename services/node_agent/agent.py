"""The node agent: registers its Node, finds the CSI node plugin through kubelet's
plugin-registration socket, and mounts and unmounts the volumes of the pods bound to its node the
way kubelet's volume manager does (unmount, mount, unstage; volumesInUse before mounting; pod
deletion finished only after unmount), then reports those pods running.

It runs no containers: a pod is "running" once its volumes are mounted.

This module only puts the four parts together over one informer factory and runs the sync loop:

    node_status.NodeStatus         the Node object, its Lease and status
    plugins.PluginManager          plugins_registry → CSI connections, CSINode
    volume_manager.VolumeManager   desired/actual state, mount/unmount operations, volumesInUse
    pod_status.PodStatus           pods Running once mounted, deletion finished once unmounted
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

from controller_runtime.client import ApiClient
from controller_runtime.clock import SYSTEM_CLOCK, Clock
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.logs import get_logger
from controller_runtime.operations import Backoff
from controller_runtime.passes import PassPacer
from controller_runtime.resources import PODS

from .disk import Layout
from .node_status import NodeStatus
from .plugins import PluginManager
from .pod_status import PodStatus
from .volume_manager import VolumeManager, pods_on_node
from .volume_stats import VolumeStatsCollector, gather

log = get_logger("node-agent")


@dataclass(frozen=True)
class Options:
    loop_period: float = 0.1
    lease_duration: int = 40
    heartbeat: float = 10.0
    status_report: float = 60.0
    csi_timeout: float = 60.0
    backoff_start: float = 0.5
    backoff_max: float = 122.0
    # Volume operations (stage+publish, unpublish, unstage) running at once; 0 = no limit (kubelet's
    # operation executor has none). Always one operation per volume at a time. Waiters start in the
    # order they were queued (an unstage first: it finishes a volume), so on a busy node the first
    # pods finish first instead of every operation sharing the CPU with every other one and all of
    # them finishing together at the end.
    max_concurrent_operations: int = 8
    # On a requested stop (SIGTERM/SIGINT), unpublish and unstage every volume before exiting: for
    # a node whose agent stops with it (the local stack, docker-compose), where a volume left
    # mounted would outlive the stack. Off by default, as kubelet: a restarted kubelet finds its
    # running pods' volumes mounted and leaves them so.
    unmount_on_exit: bool = False
    capacity: tuple[tuple[str, str], ...] = (("cpu", "4"), ("memory", "8Gi"), ("pods", "110"))
    # kubelet's volumeStatsAggPeriod: how often each claim's volume is asked for its usage (the
    # kubelet_volume_stats_* metrics); 0 turns the metrics off, as in kubelet.
    volume_stats_period: float = 60.0
    # Where /metrics is served (http://host:port/metrics), put on the Node; "" when not served.
    metrics_url: str = ""


class NodeAgent:
    def __init__(
        self,
        client: ApiClient,
        recorder: EventRecorder,
        node_name: str,
        root_dir: Path,
        options: Options | None = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.node_name = node_name
        self.clock = clock  # the passes' pacing, the operations' backoff (a test's FakeClock)
        self.layout = Layout(Path(os.path.abspath(root_dir)))
        self.options = opts = options or Options()
        self.node_status = NodeStatus(
            client,
            node_name,
            capacity=opts.capacity,
            lease_duration=opts.lease_duration,
            heartbeat=opts.heartbeat,
            status_report=opts.status_report,
            clock=clock,
            metrics_url=opts.metrics_url,
        )
        self.plugins = PluginManager(
            client, node_name, self.layout.plugins_registry(), csi_timeout=opts.csi_timeout
        )
        # The caches of this node's pods and Node, and of the claims, volumes, attachments and
        # CSIDrivers: one informer each, shared by the volume manager and the pod status.
        self.informers = SharedInformerFactory(client)
        self.volumes = VolumeManager(
            self.informers,
            recorder,
            node_name,
            self.layout,
            self.plugins.plugins,
            csi_timeout=opts.csi_timeout,
            backoff=Backoff(opts.backoff_start, opts.backoff_max),
            max_concurrent_operations=opts.max_concurrent_operations,
            clock=clock,
        )
        pods = self.informers.informer(PODS, field_selector=pods_on_node(node_name))
        self.pod_status = PodStatus(client, pods, self.layout.root / "pods", self.volumes)
        self._tasks: list[asyncio.Task[None]] = []
        self.ready = False
        # kubelet's volume metrics; registered on /metrics by the process (main), once.
        self.volume_stats = VolumeStatsCollector()

    async def reconcile(self) -> None:
        """One pass of the sync loop: volumes first, then the pod statuses they allow (written in
        the background)."""
        complete = await self.volumes.reconcile()
        with self.volumes.deciding:
            self.pod_status.sync(complete)

    async def run(self) -> None:
        """Runs until cancelled, which is how a stop is asked for (process.main cancels the main
        task on SIGTERM/SIGINT); any other end is a crash, and a crash unmounts nothing."""
        stop_requested = False
        try:
            await self._serve()
        except asyncio.CancelledError:
            stop_requested = True
            raise
        finally:
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.pod_status.stop()
            await self.volumes.stop()
            await self.informers.stop()
            if stop_requested and self.options.unmount_on_exit:
                await self._unmount_all()
            await self.plugins.close()

    async def _serve(self) -> None:
        await self.node_status.register()
        self._tasks.append(asyncio.create_task(self.node_status.heartbeat(), name="heartbeat"))
        while not self.plugins.plugins:
            await self.plugins.discover()
            if not self.plugins.plugins:
                await self.clock.sleep(0.5)
        self._tasks.append(asyncio.create_task(self.plugins.watch(), name="plugin-watch"))
        self.informers.start()
        await self.informers.wait_for_sync()
        self.volumes.restore_from_disk()
        await asyncio.to_thread(self.volumes.remove_orphan_pod_dirs)
        self.ready = True
        if self.options.volume_stats_period > 0:
            self._tasks.append(asyncio.create_task(self._collect_volume_stats(), name="volume-stats"))
        log.info("node agent ready", node=self.node_name, plugins=",".join(self.plugins.plugins))
        # Passes no closer together than a tenth of the loop period: a burst of events (eight
        # unstages finishing) makes one volumesInUse write, not eight.
        pacer = PassPacer(
            self.volumes.wake, self.options.loop_period, self.options.loop_period / 10, self.clock
        )
        while True:
            try:
                await self.reconcile()
            except Exception:
                log.exception("reconcile pass failed")
            pacer.pass_ended(self.volumes.deciding.take())
            await pacer.next_pass()

    async def _collect_volume_stats(self) -> None:
        while True:
            plugins = self.plugins.plugins
            nodes = {name: p.conn.node for name, p in plugins.items() if p.volume_stats}
            stats = await gather(self.volumes.stats_targets(), nodes, self.options.csi_timeout)
            self.volume_stats.replace(stats)
            await self.clock.sleep(self.options.volume_stats_period)

    async def _unmount_all(self) -> None:
        """The node shuts down with its agent: its volumes go with it (the plugin still runs, since
        the stack and compose stop a node agent before its node plugin)."""
        self.ready = False
        started = self.clock.monotonic()
        done, left = await self.volumes.unmount_all()
        log_at = log.warning if left else log.info
        log_at(
            "volumes unmounted for shutdown",
            node=self.node_name,
            volumes=done,
            left_mounted=left,
            took=f"{self.clock.monotonic() - started:.2f}s",
        )
