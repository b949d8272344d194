"""Who may take part in a transfer, and where the peers are (docs/transfer.md, "Who may pull").

A node plugin pulls from another only as another node plugin of the same driver, proven the way the
external-snapshot-metadata sidecar proves its clients: a ServiceAccount token bound to an audience
of its own, checked by the server with a TokenReview. kubelet projects that token into the plugin's
pod, bound to the pod, so the review also names the node the pod runs on
(`authentication.kubernetes.io/node-name`, ServiceAccountTokenPodNodeInfo, GA in 1.32): the server
learns which node asks without trusting anything the client says. A peer is accepted when the
review authenticates the token for this transfer audience, under the very ServiceAccount this
plugin runs as (it reviews its own token at start to learn it), from a pod on a node. Nothing to
distribute or rotate: kubelet renews the token, and a node that leaves the cluster takes its pods'
tokens with it.

The bytes travel under TLS: the first plugin to start makes a CA and a serving pair for the name
`transfer.<driver>` and keeps them in a Secret of its namespace; every plugin serves with that pair
and trusts that CA only, so a volume's data never crosses the network in the clear and a token is
never sent to anything but another plugin.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import os
import ssl
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from controller_runtime.certs import PKI
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.kinds import node_view, pod_view, token_review_view
from controller_runtime.logs import get_logger
from controller_runtime.resources import NODES, PODS, SECRETS, TOKEN_REVIEWS

from ..errors import exhausted, failed_precondition, not_found, unavailable
from . import client as transfer_client
from .client import PullResult
from .errors import SourceNotFound, StreamCut, TransferDenied, TransferError
from .wire import RemoteSource

log = get_logger("csi.transfer")

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
TLS_FILES = ("ca.crt", "tls.crt", "tls.key")
# A reviewed token is trusted this long before it is reviewed again: a pull's requests come in
# bursts (a HEAD to every peer, then a GET), and kubelet renews tokens hours before they expire.
REVIEW_CACHE_SECONDS = 60.0
REVIEW_CACHE_SIZE = 256


class PeerRefused(Exception):
    """A token that does not prove another node plugin of this driver; the message says why."""


@dataclass(frozen=True)
class TransferConfig:
    node: str
    port: int
    address: str  # where this plugin's server listens; its peers are reached at their pod IPs
    namespace: str
    peer_selector: str  # label selector of the node plugins' pods
    token_file: Path
    audience: str
    tls_secret: str
    tls_dir: Path
    server_name: str  # the DNS name of the serving certificate; every client checks it
    topology_key: str  # the label of the nodes this driver's plugins registered on


@dataclass(frozen=True)
class Located:
    node: str
    endpoint: tuple[str, int]
    info: RemoteSource


class PeerAccess:
    def __init__(self, client: ApiClient, config: TransferConfig) -> None:
        self.client = client
        self.config = config
        self.own_user = ""
        self._reviews: dict[str, tuple[str, float]] = {}
        self.server_context: ssl.SSLContext | None = None
        self._client_context: ssl.SSLContext | None = None
        self.ready = False  # started and serving (csi_driver.transfer.service)

    @property
    def client_context(self) -> ssl.SSLContext:
        assert self._client_context is not None, "PeerAccess.start() first"
        return self._client_context

    # --- start-up -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Learns this plugin's own identity and makes (or reads) the TLS material."""
        user, node = await self._review(self.token())
        if node != self.config.node:
            raise RuntimeError(
                f"the transfer token in {self.config.token_file} is bound to node {node or '(none)'}, "
                f"not to this plugin's node {self.config.node}: mount a projected token of the pod"
            )
        self.own_user = user
        await self._tls_material()
        self.server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.server_context.load_cert_chain(self.config.tls_dir / "tls.crt", self.config.tls_dir / "tls.key")
        self._client_context = ssl.create_default_context(cafile=str(self.config.tls_dir / "ca.crt"))
        log.info("transfer peers authenticate as", user=user, audience=self.config.audience)

    async def _tls_material(self) -> None:
        """Reads the CA and serving pair from the Secret the chart makes (empty), filling it first
        when no plugin has: the plugin may update that one Secret and create none, so it cannot
        make Secrets of other kinds in its namespace (a bootstrap token in kube-system)."""
        name, namespace = self.config.tls_secret, self.config.namespace
        while True:
            try:
                secret = await self.client.get(SECRETS, name, namespace)
            except ApiError as e:
                if e.not_found:
                    raise RuntimeError(
                        f"Secret {namespace}/{name} does not exist: the chart makes it (empty) for the "
                        "first plugin to fill in"
                    ) from e
                raise
            data = secret.get("data") or {}
            if not data:
                secret["data"] = self._new_material()
                try:
                    secret = await self.client.update(SECRETS, secret)
                    log.info("made the transfer CA and serving pair", secret=name)
                except ApiError as e:
                    if not e.conflict:  # another plugin filled it first: use theirs
                        raise
                    continue
                data = secret.get("data") or {}
            break
        missing = [f for f in TLS_FILES if f not in data]
        if missing:
            raise RuntimeError(
                f"Secret {namespace}/{name} lacks {', '.join(missing)}; empty its data to have it made anew"
            )
        self.config.tls_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.config.tls_dir, 0o700)
        for f in TLS_FILES:
            path = self.config.tls_dir / f
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(base64.b64decode(data[f]))

    def _new_material(self) -> dict[str, str]:
        """A CA and a serving pair for the transfers' name, base64 for a Secret; the CA's key is
        dropped once it signed (a new pair means emptying the Secret, and every plugin reads it at
        its next start)."""
        with tempfile.TemporaryDirectory() as tmp:
            pki = PKI(Path(tmp), ca_name=f"kubeloop-transfer-{self.config.server_name}")
            ca = pki.ensure_ca()
            serving = pki.ensure_serving("tls", self.config.server_name, [self.config.server_name], ())
            pem = {"ca.crt": ca.cert, "tls.crt": serving.cert, "tls.key": serving.key}
            return {k: base64.b64encode(v.read_bytes()).decode() for k, v in pem.items()}

    # --- authentication -------------------------------------------------------------------------
    def token(self) -> str:
        """This plugin's current transfer token (kubelet rewrites the file as it renews it)."""
        return self.config.token_file.read_text().strip()

    async def _review(self, token: str) -> tuple[str, str]:
        """(username, node) of a token the API server authenticates for the transfer audience."""
        review = token_review_view(
            await self.client.create(
                TOKEN_REVIEWS,
                {"spec": {"token": token, "audiences": [self.config.audience]}},
            )
        )
        status = review.get("status") or {}
        if not status.get("authenticated"):
            raise PeerRefused(f"the token is not valid: {status.get('error') or 'not authenticated'}")
        if self.config.audience not in (status.get("audiences") or []):
            raise PeerRefused(f"the token is not for the audience {self.config.audience}")
        user = status.get("user") or {}
        nodes = (user.get("extra") or {}).get(NODE_NAME_EXTRA) or []
        return str(user.get("username", "")), str(nodes[0]) if nodes else ""

    async def authenticate(self, token: str) -> str:
        """The node of the peer plugin whose token this is; PeerRefused when it is none."""
        now = time.monotonic()
        cached = self._reviews.get(token)
        if cached is not None and cached[1] > now:
            return cached[0]
        # An API server that cannot be asked is not a refusal: the server answers 503, and the
        # peer's retry comes back.
        user, node = await self._review(token)
        if user != self.own_user:
            raise PeerRefused(f"{user} is not a node plugin of this driver (they run as {self.own_user})")
        if not node:
            raise PeerRefused("the token is not bound to a pod on a node: use the pod's projected token")
        if len(self._reviews) >= REVIEW_CACHE_SIZE:
            self._reviews = {t: v for t, v in self._reviews.items() if v[1] > now}
            if len(self._reviews) >= REVIEW_CACHE_SIZE:
                self._reviews.clear()
        self._reviews[token] = (node, now + REVIEW_CACHE_SECONDS)
        return node

    # --- peers ----------------------------------------------------------------------------------
    async def endpoints(self) -> dict[str, tuple[str, int]]:
        """node -> (address, port) of every running node plugin but this one."""
        pods, _ = await self.client.list_all(
            PODS, self.config.namespace, labelSelector=self.config.peer_selector
        )
        out: dict[str, tuple[str, int]] = {}
        for pod in map(pod_view, pods):
            node = pod.get("spec", {}).get("nodeName", "")
            status = pod.get("status", {})
            if node and node != self.config.node and status.get("phase") == "Running" and status.get("podIP"):
                out[node] = (str(status["podIP"]), self.config.port)
        return out

    async def endpoint(self, node: str) -> tuple[str, int]:
        found = (await self.endpoints()).get(node)
        if found is None:
            raise unavailable(f"no running node plugin of this driver on node {node}")
        return found

    async def ask(self, node: str, endpoint: tuple[str, int], kind: str, source_id: str) -> Located | None:
        """Whether `node`'s plugin holds a ready `kind` (volume or snapshot) `source_id` (None: it
        answered that it does not); a peer that cannot answer raises UNAVAILABLE."""
        try:
            info = await transfer_client.describe(
                endpoint, self.client_context, self.config.server_name, self.token(), self.config.node,
                kind, source_id,
            )  # fmt: skip
        except (TimeoutError, OSError, TransferError) as e:
            raise unavailable(f"the plugin of node {node} did not answer: {e}") from e
        return None if info is None else Located(node, endpoint, info)

    def _check_ready(self) -> None:
        if not self.ready:
            raise unavailable(f"transfers of node {self.config.node} are not started yet (see its log)")

    async def locate(self, kind: str, source_id: str) -> Located:
        """The peer that holds a ready `source_id`, every peer asked at once. NOT_FOUND only when
        every node of the driver answered that it does not hold it; UNAVAILABLE when one that may
        hold it did not answer (a claim must not be sent elsewhere for a peer that restarts)."""
        self._check_ready()
        peers = await self.endpoints()
        answers = await asyncio.gather(
            *(self.ask(n, e, kind, source_id) for n, e in sorted(peers.items())), return_exceptions=True
        )
        silent: list[str] = []
        for node, answer in zip(sorted(peers), answers, strict=True):
            if isinstance(answer, Located):
                return answer
            if isinstance(answer, BaseException):
                log.warning("a peer did not answer", node=node, error=str(answer))
                silent.append(node)
        missing = await self._nodes_without_plugin(set(peers))
        if silent or missing:
            raise unavailable(
                f"source {kind} {source_id} is not in the pools that answered; unanswered: "
                f"{', '.join(sorted([*silent, *missing]))} (no running plugin, or no answer); "
                "the next try asks again"
            )
        raise not_found(f"source {kind} {source_id} is in the pool of no node of this driver")

    async def _nodes_without_plugin(self, answered: set[str]) -> list[str]:
        """The nodes that carry this driver's topology label but no running plugin answered for."""
        nodes, _ = await self.client.list_all(NODES, labelSelector=self.config.topology_key)
        names = {node_view(n)["metadata"]["name"] for n in nodes}
        return sorted(names - answered - {self.config.node})

    async def pull(self, node: str, kind: str, source_id: str, final_path: str, size: int) -> PullResult:
        """Pulls `kind` `source_id` from `node`'s plugin into `final_path` (of `size` bytes),
        resuming a pull a cut stream or a kill left; a CSI error says what failed. UNAVAILABLE
        (a peer gone, a stream cut) is the one the caller's retry resumes from."""
        self._check_ready()
        endpoint = await self.endpoint(node)
        where = f"{kind} {source_id} from node {node}"
        try:
            return await transfer_client.pull(
                endpoint, self.client_context, self.config.server_name, self.token(), self.config.node,
                kind, source_id, final_path, size,
            )  # fmt: skip
        except SourceNotFound as e:
            raise not_found(f"pulling {where}: {e.message}") from e
        except TransferDenied as e:
            raise failed_precondition(f"pulling {where} was refused: {e.message}") from e
        except StreamCut as e:
            raise unavailable(f"pulling {where} was cut ({e.message}); the next try resumes it") from e
        except TransferError as e:
            raise failed_precondition(f"pulling {where} failed: {e.message}") from e
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise exhausted(f"the pool of node {self.config.node} is full: {e.strerror}") from e
            if isinstance(e, ConnectionError | TimeoutError):
                raise unavailable(f"pulling {where}: {e}; the next try resumes it") from e
            raise
