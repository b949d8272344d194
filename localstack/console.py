"""The launcher's console: the stdout and stderr of `make up`, read by a person.

A console can go away while the stack runs: the `tee` of `make up 2>&1 | tee up.log` ends with the
same Ctrl-C as the launcher, an ssh session drops, a tmux window is killed. From then on every write
fails (EPIPE on a pipe without a reader, EIO on a hung-up terminal), and an exception out of a
`print` would end the launcher before its ordered stop, leaving the volumes mounted. So the
launcher's sys.stdout and sys.stderr are ConsoleStreams: a write that fails marks the stream lost,
and from then on what was meant for it goes to the launcher's log (`logs/stack.log`) instead. Losing
the console never changes how the stack runs or stops.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import sys
from collections.abc import Callable

from controller_runtime.logs import get_logger

log = get_logger("console")


class ConsoleStream(io.TextIOBase):
    """A text stream on a file descriptor whose writes never raise. Each write goes straight to the
    descriptor (nothing stays buffered for the interpreter to flush, and fail on, at exit)."""

    # Set while a dropped line is being logged: with --verbose the log's own handler writes to the
    # (lost) stderr, which must drop that line instead of logging it again.
    _logging = False

    def __init__(self, fd: int, name: str, encoding: str = "utf-8") -> None:
        super().__init__()
        self._fd = fd
        self._name = name
        self._encoding = encoding
        self.lost: OSError | None = None

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._encoding

    @property
    def name(self) -> str:
        return self._name

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return self.lost is None and os.isatty(self._fd)

    def flush(self) -> None:
        """Nothing to do: every write has reached the descriptor, or been dropped."""

    def write(self, text: str) -> int:
        if self.lost is None:
            data = text.encode(self._encoding, errors="replace")
            try:
                while data:
                    try:
                        data = data[os.write(self._fd, data) :]
                    except BlockingIOError:
                        # A terminal another program left non-blocking is full for a moment, not
                        # gone: wait until it takes more (a second at most, then it counts as gone).
                        if not select.select([], [self._fd], [], 1.0)[1]:
                            raise
                return len(text)
            except OSError as e:
                self.lost = e
                self._log(
                    log.warning,
                    f"the console's {self._name} is gone ({e.strerror or e}); what it would show "
                    "is in this log from now on",
                )
        if text.strip():
            self._log(log.info, "not shown on the console", text=text.rstrip("\n"))
        return len(text)

    def _log(self, emit: Callable[..., None], msg: str, **fields: str) -> None:
        if ConsoleStream._logging:
            return
        ConsoleStream._logging = True
        try:
            emit(msg, stream=self._name, **fields)
        finally:
            ConsoleStream._logging = False


def install() -> None:
    """Replaces sys.stdout and sys.stderr with ConsoleStreams on the same descriptors; to be called
    before anything is printed or any log handler takes sys.stderr."""
    for attr, fd in (("stdout", 1), ("stderr", 2)):
        current = getattr(sys, attr)
        if isinstance(current, ConsoleStream) or current is None:
            continue
        with contextlib.suppress(OSError, ValueError):  # a console gone already, or closed
            current.flush()
        setattr(sys, attr, ConsoleStream(fd, f"<{attr}>", getattr(current, "encoding", None) or "utf-8"))
