"""Transfers in a node-local plugin (`--transfer-port`): the pool's files offered to the other
nodes' plugins, sources of restores and clones pulled from them, and moves carried out.

The driver starts this only with --node-local in --mode all (the pool is this node's alone and
this process serves its controller): csi_driver.main calls `start` after the controller reconciled
the pool, and `stop` on its way out.
"""

from __future__ import annotations

import asyncio
import itertools
from contextlib import AbstractAsyncContextManager

from controller_runtime.client import ApiClient
from controller_runtime.logs import get_logger

from ..controller import ControllerServer
from ..state import DriverState
from .access import PeerAccess, PeerRefused, TransferConfig
from .errors import TransferDenied
from .moves import MoveController
from .server import TransferServer, file_generation
from .snapshot_owners import SnapshotOwners
from .wire import SourceInfo

log = get_logger("csi.transfer")


class PoolSources:
    """What this node's pool offers: ready volumes and snapshots (a volume still being pulled or
    made is not one), each streamed under the driver's lock on its id."""

    def __init__(self, state: DriverState) -> None:
        self.state = state

    def describe(self, kind: str, source_id: str) -> SourceInfo | None:
        if kind == "volume":
            vol = self.state.volume(source_id)
            if vol is None or not vol.ready:
                return None
            path, size, access_type, fs_type = (
                self.state.volume_file(source_id), vol.capacity, vol.access_type, vol.fs_type,
            )  # fmt: skip
        else:
            snap = self.state.snapshot(source_id)
            if snap is None or not snap.ready:
                return None
            path, size, access_type, fs_type = (
                self.state.snapshot_file(source_id), snap.size, snap.access_type, snap.fs_type,
            )  # fmt: skip
        try:
            generation = file_generation(path)
        except FileNotFoundError:
            return None  # a record whose file is missing (reported at start) offers nothing
        return SourceInfo(path, size, generation, access_type, fs_type)

    def hold(self, source_id: str) -> AbstractAsyncContextManager[None]:
        return self.state.locks.hold(source_id)


# Between tries to start transfers (the API server unreachable, the TLS Secret not made yet).
RETRY_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0)
# How often half-made pulls nobody came back for are looked for (ControllerServer.sweep_stale_pulls).
SWEEP_SECONDS = 600.0


class Transfers:
    """Transfers in this plugin, started in the background: the CSI socket is served meanwhile, so
    a plugin restarted while the API server is away still stages and unstages its volumes, and a
    restore that needs a peer answers UNAVAILABLE until transfers are up (PeerAccess.ready)."""

    def __init__(
        self, client: ApiClient, config: TransferConfig, controller: ControllerServer, driver: str
    ) -> None:
        self.client, self.config, self.controller, self.driver = client, config, controller, driver
        self.peers = PeerAccess(client, config)
        controller.peers = self.peers
        self.server: TransferServer | None = None
        self.owners: SnapshotOwners | None = None
        self._tasks: list[asyncio.Task[None]] = [asyncio.create_task(self._start(), name="transfers")]

    async def _start(self) -> None:
        for attempt in itertools.count():
            try:
                await self.peers.start()
                break
            except Exception as e:
                wait = RETRY_SECONDS[min(attempt, len(RETRY_SECONDS) - 1)]
                log.error("transfers cannot start yet; retrying", error=str(e), retry_in=f"{wait}s")
                await asyncio.sleep(wait)
        assert self.peers.server_context is not None
        self.server = TransferServer(
            node=self.config.node,
            sources=PoolSources(self.controller.state),
            authenticate=self._authenticate,
            ssl_context=self.peers.server_context,
            host=self.config.address,
            port=self.config.port,
        )
        await self.server.start()
        self.peers.ready = True
        moves = MoveController(
            self.client, self.peers, self.controller, self.driver, self.config.topology_key
        )
        self._tasks.append(asyncio.create_task(moves.run(), name="volume-moves"))
        self._tasks.append(asyncio.create_task(self._sweep(), name="stale-pulls"))
        owners = SnapshotOwners(self.client, self.controller.state, self.config.node, self.driver)
        if await owners.available():
            owners.start()
            self.owners = owners
        else:
            log.info(
                "the cluster serves no VolumeSnapshotContents: pre-provisioned snapshots are not labelled"
            )
        log.info(
            "transfers on", node=self.config.node, port=self.config.port, peers=self.config.peer_selector
        )

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            await self.controller.sweep_stale_pulls()

    async def _authenticate(self, token: str) -> str:
        try:
            return await self.peers.authenticate(token)
        except PeerRefused as e:
            raise TransferDenied(str(e)) from e

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.owners is not None:
            await self.owners.stop()
        if self.server is not None:
            await self.server.stop()
        await self.client.close()


async def start(
    kubeconfig: str, config: TransferConfig, controller: ControllerServer, driver: str
) -> Transfers:
    client = await ApiClient.from_kubeconfig(kubeconfig, user_agent="kubeloop-csi-driver")
    return Transfers(client, config, controller, driver)
