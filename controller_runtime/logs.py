"""Structured logging: `key=value` text (default) or one JSON object per line (--log-format=json).

Call sites pass fields as keyword arguments, `log.info("bound claim", claim="ns/name", volume=pv)`,
so both formats carry the same fields and operators can grep or parse either.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

_FIELDS = "kubeloop_fields"


# Control characters (C0, DEL, C1) in a logged value, which may come from a request: written raw,
# an ESC sequence would reach the operator's terminal and a newline could forge a log line.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _escape_control(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


# What makes a value quoted: a space, '=' or '"' (which would break key=value parsing), or a control.
_NEEDS_QUOTES = re.compile('[ ="\x00-\x1f\x7f-\x9f]')


def _quote(value: Any) -> str:
    text = value if type(value) is str else str(value)
    if text == "" or _NEEDS_QUOTES.search(text):
        # json.dumps escapes C0 controls; DEL and C1 it leaves raw without ensure_ascii.
        return _CONTROL.sub(_escape_control, json.dumps(text, ensure_ascii=False))
    return text


class TextFormatter(logging.Formatter):
    # The line's time to the second, formatted once per second rather than once per line.
    _second = -1
    _stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        parts = [
            f"ts={self._stamp}.{int(record.msecs):03d}Z",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"msg={_quote(record.getMessage())}",
        ]
        for key, value in getattr(record, _FIELDS, {}).items():
            parts.append(f"{key}={_quote(value)}")
        if record.exc_info:
            parts.append(f"error={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(
            {
                k: v if isinstance(v, int | float | bool) else str(v)
                for k, v in getattr(record, _FIELDS, {}).items()
            }
        )
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc)


class Logger:
    """A thin wrapper over a stdlib logger that takes structured fields as keyword arguments."""

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name)

    def _emit(self, level: int, msg: str, exc_info: bool, fields: dict[str, Any]) -> None:
        # The record is made here and handed to the handlers: Logger.log would first walk the
        # stack for the caller's file and line, which neither format prints (7 us of a line's 26).
        logger = self._log
        if logger.isEnabledFor(level):
            record = logger.makeRecord(
                logger.name, level, "", 0, msg, (), sys.exc_info() if exc_info else None,
                extra={_FIELDS: fields},
            )  # fmt: skip
            logger.handle(record)

    def debug(self, msg: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, msg, False, fields)

    def info(self, msg: str, **fields: Any) -> None:
        self._emit(logging.INFO, msg, False, fields)

    def warning(self, msg: str, **fields: Any) -> None:
        self._emit(logging.WARNING, msg, False, fields)

    def error(self, msg: str, **fields: Any) -> None:
        self._emit(logging.ERROR, msg, False, fields)

    def exception(self, msg: str, **fields: Any) -> None:
        self._emit(logging.ERROR, msg, True, fields)


def get_logger(name: str) -> Logger:
    return Logger(name)


def log_to_file(path: Path, *, keep_stderr: bool = False) -> None:
    """Sends the process's log lines to `path` (appended) instead of stderr, formatted as before: for
    a process whose terminal is for people (`make up` prints its own status lines). `keep_stderr`:
    to the file and to stderr as before (`make up --verbose`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    formatter = root.handlers[0].formatter if root.handlers else TextFormatter()
    handler = logging.FileHandler(path)
    handler.setFormatter(formatter)
    root.handlers[:] = [handler, *(root.handlers if keep_stderr else [])]


def setup_logging(log_format: str = "text", verbosity: int = 0) -> None:
    """Configures the root logger once per process; verbosity >= 4 turns on debug (klog's -v=4)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbosity >= 4 else logging.INFO)
    # Neither format prints the thread or the process: not looked up for every record.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    # Library chatter (asyncio debug, grpc's line per call and channel) stays out unless asked
    # for: it would drown the -v=4 messages.
    for noisy in ("asyncio", "grpc"):
        logging.getLogger(noisy).setLevel(logging.WARNING if verbosity < 6 else logging.DEBUG)
