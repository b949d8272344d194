"""Transfers in a node-local plugin (`--transfer-port`): the pool's files offered to the other
nodes' plugins, sources of restores and clones pulled from them, and moves carried out.

The driver starts this only with --node-local in --mode all (the pool is this node's alone and
this process serves its controller): csi_driver.main calls `start` after the controller reconciled
the pool, and `stop` on its way out.
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

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


@dataclass
class Transfers:
    client: ApiClient
    server: TransferServer
    moves: asyncio.Task[None]
    owners: SnapshotOwners | None

    async def stop(self) -> None:
        self.moves.cancel()
        await asyncio.gather(self.moves, return_exceptions=True)
        if self.owners is not None:
            await self.owners.stop()
        await self.server.stop()
        await self.client.close()


async def start(
    kubeconfig: str, config: TransferConfig, controller: ControllerServer, driver: str, topology_key: str
) -> Transfers:
    client = await ApiClient.from_kubeconfig(kubeconfig, user_agent="kubeloop-csi-driver")
    try:
        peers = PeerAccess(client, config)
        await peers.start()
        assert peers.server_context is not None

        async def authenticate(token: str) -> str:
            try:
                return await peers.authenticate(token)
            except PeerRefused as e:
                raise TransferDenied(str(e)) from e

        server = TransferServer(
            node=config.node,
            sources=PoolSources(controller.state),
            authenticate=authenticate,
            ssl_context=peers.server_context,
            host=config.address,
            port=config.port,
        )
        await server.start()
    except BaseException:
        await client.close()
        raise
    controller.peers = peers
    moves = MoveController(client, peers, controller, driver, topology_key)
    task = asyncio.create_task(moves.run(), name="volume-moves")
    owners: SnapshotOwners | None = None
    candidate = SnapshotOwners(client, controller.state, config.node, driver)
    if await candidate.available():
        candidate.start()
        owners = candidate
    else:
        log.info("the cluster serves no VolumeSnapshotContents: pre-provisioned snapshots are not labelled")
    log.info("transfers on", node=config.node, port=config.port, peers=config.peer_selector)
    return Transfers(client, server, task, owners)
