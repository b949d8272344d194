"""What a transfer can fail with, on either side: each error carries one sentence an operator can
act on, the server's own when the server refused."""

from __future__ import annotations


class TransferError(Exception):
    """A transfer that did not complete; `message` says why, `status` is the server's HTTP status
    when the server refused (0 otherwise)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class TransferDenied(TransferError):
    """The peer is not who it must be: a missing or rejected token (401), or a token of another
    node than the one the request names (403). The server's authenticator raises it too."""


class BadRequest(TransferError):
    """The server refused the request itself (400, 405): an invalid id or region index."""


class SourceNotFound(TransferError):
    """The server's pool has no ready volume or snapshot of that id (404)."""


class StreamCut(TransferError):
    """The connection failed or ended before the end marker: what was verified stays in the
    destination's part file, and the next pull resumes from it."""


class CorruptStream(TransferError):
    """The stream arrived but is not what the source holds (a digest that does not match, or
    framing that breaks the format): nothing of it is kept."""
