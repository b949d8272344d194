"""A listening socket served on threads, one per connection, for the node sidecars that import no
asyncio: their HTTP endpoint (health_threads) and node-driver-registrar's registration socket
(grpc_lite.server). Stopping wakes the accepting thread through a socket pair and every
connection's thread by shutting its socket's reading side down, so no thread is left behind."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections.abc import Callable

from .logs import get_logger

log = get_logger("server")

# Connections served at once; more wait in the listen backlog (a local peer opening sockets in a
# loop gets no thread each).
MAX_CONNECTIONS = 32


class ThreadedListener:
    """Calls `serve(connection)` on a thread of its own for each connection `listener` accepts;
    `serve` need not close the connection."""

    def __init__(self, listener: socket.socket, serve: Callable[[socket.socket], None], name: str) -> None:
        self.listener = listener
        self._serve = serve
        self._name = name
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._connections: dict[threading.Thread, socket.socket] = {}
        self._stopping = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)

    def start(self) -> None:
        self._acceptor.start()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self, grace: float) -> None:
        """Stops accepting and ends every connection, waiting up to `grace` seconds for each
        thread (a thread still in a handler is left to finish as a daemon)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._acceptor.is_alive():
            self._acceptor.join(grace)
        with self._lock:
            connections = dict(self._connections)
        for sock in connections.values():
            with contextlib.suppress(OSError):
                # Wakes the thread's recv with end of file; its writing side stays open, so an
                # answer being made (kubelet's NotifyRegistrationStatus, which stops the process)
                # still goes out first.
                sock.shutdown(socket.SHUT_RD)
        for thread in connections:
            thread.join(grace)
        self.listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def threads(self) -> int:
        with self._lock:
            return len(self._connections)

    def _accept(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.listener, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping.is_set():
                if self.threads() >= MAX_CONNECTIONS:
                    self._stopping.wait(0.05)
                    continue
                if not any(key.fileobj is self.listener for key, _ in selector.select()):
                    continue
                try:
                    sock, _ = self.listener.accept()
                except OSError:
                    continue
                name = f"{self._name}-conn"
                thread = threading.Thread(target=self._run, args=(sock,), name=name, daemon=True)
                with self._lock:
                    self._connections[thread] = sock
                thread.start()

    def _run(self, sock: socket.socket) -> None:
        try:
            self._serve(sock)
        except Exception:
            log.exception("serving a connection failed", server=self._name)
        finally:
            sock.close()
            with self._lock:
                self._connections.pop(threading.current_thread(), None)
